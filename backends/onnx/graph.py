"""ONNX graphs under construction: ``Graph`` (nodes, inputs, outputs, initializers of the main graph or a
Scan/Loop body, symbolic dims as shape subgraphs), ``Lowering`` (what a table emitter sees), the opsets
(``OPSETS``, ``default_opset``, ``check_opset``) and the IR -> ONNX type and shape mappings. The exporter
(``export.py``) and the lowering table (``lowering.py``) both build on this module."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Operation
from k3ir.ops.state import state_tensor_type
from k3ir.types import StateType, TensorType

if TYPE_CHECKING:                       # annotations only: the exporter builds Graphs
    from .export import OnnxExporter

log = logging.getLogger("k3ir.onnx")

OPSETS = (27, 20)
#: the first onnxruntime release that runs opset 27 (LinearAttention, CausalConvWithState) on CPU
ORT_FOR_OPSET27 = (1, 32)


def _onnx():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise K3BackendError("ONNX export needs the 'onnx' package (pip install 'k3ir[onnx]')") from e
    return onnx


def default_opset() -> int:
    """27, unless an installed onnxruntime is older than ``ORT_FOR_OPSET27`` (then 20)."""
    try:
        import onnxruntime
    except ImportError:
        return 27
    parts = []
    for p in onnxruntime.__version__.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return 27 if tuple(parts) >= ORT_FOR_OPSET27 else 20


def check_opset(opset: int | None) -> int:
    """The opset to export: ``opset`` (one of ``OPSETS``) or ``default_opset()`` for None.
    Raises K3BackendError for another value."""
    if opset is None:
        return default_opset()
    if opset not in OPSETS:
        raise K3BackendError(f"ONNX export supports opset {' or '.join(map(str, OPSETS))}, not {opset}")
    return int(opset)


def elem_type(ir_dtype: str, compute: str = "float32") -> int:
    """ONNX TensorProto element type for an IR dtype; float IR dtypes compute in ``compute``."""
    P = _onnx().TensorProto
    if ir_dtype in ("bf16", "f16", "f32", "f64", "fp8e4m3"):
        return {"float32": P.FLOAT, "float16": P.FLOAT16, "float64": P.DOUBLE}[compute]
    return {"i64": P.INT64, "i32": P.INT32, "i8": P.INT8, "u8": P.UINT8, "bool": P.BOOL,
            "mxfp4": P.UINT8, "int4": P.INT32}[ir_dtype]


def runtime_shape(t: TensorType) -> list:
    """Run-time array shape: packed ``mxfp4[..., K]`` is ``u8[..., K/2]``, ``int4`` is ``i32[..., K/8]``."""
    shape = list(t.shape)
    if t.dtype in ("mxfp4", "int4") and shape:
        shape[-1] = int(shape[-1]) // (2 if t.dtype == "mxfp4" else 8)
    return shape


def state_shape(t: StateType, batch="B") -> list:
    return list(state_tensor_type(t, batch).shape)


class Graph:
    """One ONNX graph under construction (the main graph or a Scan body)."""

    def __init__(self, exporter: OnnxExporter, name: str):
        self.x = exporter
        self.name = name
        self.nodes: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.initializers: list = []
        self._consts: dict[tuple, str] = {}
        self.dims: dict[str, tuple[str, int]] = {}      # symbolic dim name -> (value name, axis)
        self._dim_cache: dict[str, str] = {}

    def node(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs: Any):
        """Append a node; returns its output name (or a list when ``n_out > 1``)."""
        onnx = _onnx()
        outs = [self.x.fresh(op_type) for _ in range(n_out)]
        self.nodes.append(onnx.helper.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype: str = "float32") -> str:
        """A Constant node (deduplicated per graph); scalar or 1-D."""
        onnx = _onnx()
        arr = np.asarray(value, dtype=dtype)
        key = (dtype, arr.shape, arr.tobytes())
        if key not in self._consts:
            out = self.x.fresh("const")
            self.nodes.append(onnx.helper.make_node("Constant", [], [out],
                                                    value=onnx.numpy_helper.from_array(arr, out)))
            self._consts[key] = out
        return self._consts[key]

    def fconst(self, value: float) -> str:
        return self.const(value, self.x.np_float)

    def ints(self, values) -> str:
        return self.const(np.asarray(values, dtype=np.int64).reshape(-1), "int64")

    def bind_dims(self, name: str, t) -> None:
        """Record where the symbolic dims of a graph input ``name`` of type ``t`` can be read."""
        shape = state_shape(t) if isinstance(t, StateType) else list(t.shape)
        for axis, d in enumerate(shape):
            if isinstance(d, str) and d.isidentifier() and d not in self.dims:
                self.dims[d] = (name, axis)

    def dim(self, d) -> str:
        """An int64 ``[1]`` tensor holding dimension ``d`` (int, name or ``+``/``-`` expression)."""
        if isinstance(d, int):
            return self.ints([d])
        if d in self._dim_cache:
            return self._dim_cache[d]
        if d in self.dims:
            src, axis = self.dims[d]
            out = self.node("Shape", [src], start=axis, end=axis + 1)
        else:
            import re
            terms = re.findall(r"([+-]?)([^+-]+)", d.replace(" ", ""))
            if not terms or any("*" in a for _, a in terms):
                raise K3BackendError(f"ONNX export: cannot resolve dimension '{d}'")
            out = None
            for sign, atom in terms:
                t = self.ints([int(atom)]) if atom.isdigit() else self.dim(atom)
                if out is None:
                    out = t if sign != "-" else self.node("Neg", [t])
                else:
                    out = self.node("Sub" if sign == "-" else "Add", [out, t])
        self._dim_cache[d] = out
        return out

    def make(self):
        onnx = _onnx()
        return onnx.helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)


class Lowering:
    """What an emitter sees: the graph, the op (for operand/result IR types) and the exporter."""

    def __init__(self, graph: Graph, op: Operation, exporter: OnnxExporter):
        self.g, self.op, self.x = graph, op, exporter

    def etype(self, i: int, result: bool = False) -> int:
        v = (self.op.results if result else self.op.operands)[i]
        t = v.type
        return self.x.elem(t.dtype) if isinstance(t, TensorType) else self.x.elem("f32")

    def cast_to(self, name: str, src: int, dst: int) -> str:
        return name if src == dst else self.g.node("Cast", [name], to=dst)


Emitter = Callable[..., Any]
