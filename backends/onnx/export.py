"""IR function -> ONNX graph (standard ``ai.onnx`` ops only, opset 27 or 20, dynamic batch/sequence).

Ops are lowered through ``TABLE`` (op name -> emitter, in ``lowering.py``); an op without an
entry is replaced by its decomposition into core ops (``decompose_op``), recursively, exactly
like the interpreter does, so ``lowering_report`` can say which ops were lowered natively and
which fell back.

Opsets (``opset=``, default ``default_opset()``): 27 lowers KDA to ``LinearAttention``
(``gated_delta``), the short conv to ``CausalConvWithState``, RMSNorm to ``RMSNormalization`` and
MLA prefill to ``Attention``; 20 (older runtimes) decomposes them, the KDA recurrence becoming an
ONNX ``Scan`` over the time axis whose body is the scan's body function.

Weights (``weights=``): ``"embedded"`` (initializers with data), ``"external"`` (initializers
whose data lives in one side file, streamed one tensor at a time) or ``"inputs"`` (parameters
become graph inputs: structure only, no weight data at all).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module, Operation
from k3ir.opdef import instantiate
from k3ir.param_init import check_fits, init_param
from k3ir.types import StateType

from ..lowering import lower_or_decompose
from .graph import (
    Emitter,
    Graph,
    Lowering,
    _onnx,
    check_opset,
    default_opset,  # noqa: F401  (public here: the opset that opset=None picks)
    elem_type,
    runtime_shape,
    state_shape,
)
from .lowering import table_for_opset
from .moe import MOE_FORMS

WEIGHT_MODES = ("embedded", "external", "inputs")
MXFP4_FORMS = ("unpack", "dequantize_linear")
#: the graph input that selects how many trailing positions get logits (``OnnxExporter``'s ``logits_to_keep``)
LOGITS_TO_KEEP = "logits_to_keep"


class OnnxExporter:
    """Turns the functions of ``module`` into ONNX models.

    ``dtype``: compute dtype of float tensors (``float32`` | ``float16``); ``weights``: one of
    ``WEIGHT_MODES``; ``params``: name -> array for ``embedded``/``external`` (None there means a
    deterministic random init, ``k3ir.param_init.init_param``); ``opset``: 27 or 20 (None:
    ``default_opset()``), which picks the lowering table (``lowering.table_for_opset``);
    ``ort_kernels``: opset 27's ``LinearAttention`` and ``CausalConvWithState`` in onnxruntime's
    ``com.microsoft`` domain (same inputs, outputs and attributes), which onnxruntime 1.32 runs with
    native CPU kernels, where it runs the standard ops through their function bodies (a ``Scan``
    over tokens); the file then needs onnxruntime. ``moe_form``: the routed experts as ``"sorted"``
    (expert-sorted rows, one ``Gemm`` per expert on a static slice) or ``"loop"`` (a ``Loop`` over the
    experts in use); None picks ``"sorted"`` up to ``moe.SORTED_MAX_EXPERTS`` experts (``moe.py``).
    ``mxfp4_form``: MXFP4 expert weights as ``"unpack"`` (uint8 codes and E8M0 bytes, dequantised by bit
    operations and the E2M1 table: runs in onnxruntime 1.32) or ``"dequantize_linear"`` (the standard form:
    ``FLOAT4E2M1`` weights, ``FLOAT8E8M0`` scales, blocked ``DequantizeLinear``; the same bytes; opset 27 only;
    onnxruntime 1.32's CPU provider has no kernel for it). ``logits_to_keep``: the default value of the graph
    input ``logits_to_keep`` (int64 scalar, an initializer a caller may override by feeding it): the
    ``lm_head`` runs on the last ``logits_to_keep`` positions only (0: all of them), so ``logits`` is
    ``[B, T_logits, V]`` with ``T_logits = min(T, logits_to_keep)`` (``T`` for 0). Default 1: a generation
    prefill needs the last position's logits only (transformers' ``logits_to_keep``); on k3-100m the head over
    all 128 prompt positions is 4.2 of 12.9 GFLOP. Raises K3BackendError."""

    def __init__(self, module: Module, dtype: str = "float32", weights: str = "embedded",
                 params: dict[str, Any] | None = None, table: dict[str, Emitter] | None = None,
                 opset: int | None = None, ort_kernels: bool = False, moe_form: str | None = None,
                 mxfp4_form: str = "unpack", logits_to_keep: int = 1):
        if weights not in WEIGHT_MODES:
            raise K3BackendError(f"unknown weights mode '{weights}' (want one of {', '.join(WEIGHT_MODES)})")
        if dtype not in ("float32", "float16"):
            raise K3BackendError(f"ONNX export supports dtype float32 or float16, not '{dtype}'")
        self.opset = check_opset(opset)
        self.ort_kernels = bool(ort_kernels)
        if moe_form not in (None, *MOE_FORMS):
            raise K3BackendError(f"unknown moe_form '{moe_form}' (want one of {', '.join(MOE_FORMS)})")
        self.moe_form = moe_form
        if mxfp4_form not in MXFP4_FORMS:
            raise K3BackendError(f"unknown mxfp4_form '{mxfp4_form}' (want one of {', '.join(MXFP4_FORMS)})")
        if mxfp4_form == "dequantize_linear" and self.opset < 27:
            raise K3BackendError("mxfp4_form='dequantize_linear' needs opset 27 (FLOAT4E2M1, FLOAT8E8M0 scales)")
        self.mxfp4_form = mxfp4_form
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, np.integer)) or logits_to_keep < 0:
            raise K3BackendError(f"logits_to_keep must be an integer >= 0 (0: every position), not {logits_to_keep!r}")
        self.logits_to_keep = int(logits_to_keep)
        self._keep_input: str | None = None      # the kept count (from input logits_to_keep), once a lm_head asks
        self._typed_params: dict[str, int] = {}   # param -> ONNX element type other than its IR dtype's
        self.domains: set[str] = set()          # non-default operator domains the graph uses
        self.module = module
        self.dtype = dtype
        self.np_float = dtype
        self.weights = weights
        self.params = params
        self.table = table_for_opset(self.opset) if table is None else table
        self._n = 0
        self._decomp: dict[int, Function] = {}
        self.native: dict[str, int] = {}
        self.fallback: dict[str, int] = {}
        self._ext_index: dict[str, tuple[int, int]] = {}

    # ---- names and types -------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def elem(self, ir_dtype: str) -> int:
        return elem_type(ir_dtype, self.dtype)

    def value_info(self, name: str, t, batch="B"):
        onnx = _onnx()
        if name in self._typed_params:                 # FLOAT4E2M1 / FLOAT8E8M0: the IR's logical shape
            return onnx.helper.make_tensor_value_info(name, self._typed_params[name], [int(d) for d in t.shape])
        if isinstance(t, StateType):
            return onnx.helper.make_tensor_value_info(name, self.elem("f32"), [str(d) if isinstance(d, str) else d
                                                                              for d in state_shape(t, batch)])
        return onnx.helper.make_tensor_value_info(name, self.elem(t.dtype),
                                                  [str(d) if isinstance(d, str) else d for d in runtime_shape(t)])

    # ---- walking ---------------------------------------------------------------------
    def emit_function(self, g: Graph, fn: Function, arg_names: list[str]) -> list[str]:
        env: dict[int, str] = {id(a): n for a, n in zip(fn.args, arg_names)}
        joined = self._joined_only(fn)
        for op in fn.ops:
            if op.name == "k3.param":                   # a weight read only inside joined weights: no own initializer
                name = op.attrs["name"]
                env[id(op.results[0])] = name if id(op.results[0]) in joined else self.param(g, name)
                continue
            outs = self.emit_op(g, op, [env[id(v)] for v in op.operands])
            for r, o in zip(op.results, outs):
                env[id(r)] = o
        return [env[id(v)] for v in fn.returns]

    def emit_op(self, g: Graph, op: Operation, ins: list[str]) -> list[str]:
        impl, fn = lower_or_decompose(self, op)
        if fn is not None:
            return self.emit_function(g, fn, ins)
        out = impl(Lowering(g, op, self), instantiate(op), *ins)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    # ---- parameters ------------------------------------------------------------------
    def joins_weights(self, op: Operation) -> bool:
        """Whether ``op`` is a ``k3.decode_linear`` the table lowers natively whose weights are all parameters
        (``joined_weight`` then makes them one initializer)."""
        from k3ir.passes.rewrite import producer
        if op.name != "k3.decode_linear" or op.name not in self.table or self.weights == "inputs":
            return False
        when = getattr(self.table, "conditions", {}).get(op.name)
        n = 2 if op.attrs.get("glu") else int(op.attrs.get("splits", 1))
        return (when is None or when(op) is None) and all(producer(v, "k3.param") is not None
                                                          for v in op.operands[1:1 + n])

    def _joined_only(self, fn: Function) -> set[int]:
        """ids of the parameter values of ``fn`` read only as weights of ops that ``joins_weights``."""
        reads: dict[int, list[bool]] = {}
        for op in fn.ops:
            join = self.joins_weights(op)
            n = (2 if op.attrs.get("glu") else int(op.attrs.get("splits", 1))) if join else 0
            for i, v in enumerate(op.operands):
                reads.setdefault(id(v), []).append(join and 1 <= i <= n)
        returned = {id(v) for v in fn.returns}
        return {id(op.results[0]) for op in fn.ops if op.name == "k3.param" and id(op.results[0]) not in returned
                and reads.get(id(op.results[0])) and all(reads[id(op.results[0])])}

    def joined_weight(self, g: Graph, weights: list, names: list[str]) -> str:
        """One ``[sum N_i, K]`` weight of the ``[N_i, K]`` ``weights`` (IR values; ``names``: their ONNX names)
        joined along axis 0: an initializer made at export time (named by the parameters joined with ``+``), or
        a run-time ``Concat`` where a weight is not a parameter or the parameters are graph inputs."""
        from k3ir.passes.rewrite import producer
        ps = [producer(v, "k3.param") for v in weights]
        if self.weights == "inputs" or any(p is None for p in ps):
            return g.node("Concat", [self.param(g, n) if p is not None else n for p, n in zip(ps, names)], axis=0)
        parts = [p.attrs["name"] for p in ps]
        name = "+".join(parts)
        if name not in self._param_names:
            self._param_names[name] = name
            self._used_params.extend(n for n in parts if n not in self._used_params)
            self.main.initializers.append(self._initializer(name, None, parts=parts))
        return name

    def param(self, g: Graph, name: str) -> str:
        if name in self._param_names:
            return self._param_names[name]
        decl = self.module.params[name]
        self._param_names[name] = name
        self._used_params.append(name)
        if self.weights == "inputs":
            self.main.inputs.append(self.value_info(name, decl.type))
        else:
            self.main.initializers.append(self._initializer(name, decl))
        return name

    def logits_to_keep_input(self) -> str:
        """The int64 scalar the ``lm_head`` keeps: the main graph's input ``logits_to_keep`` where the caller feeds
        it, else the file's default ``self.logits_to_keep``. The input is typed ``optional(tensor(int64))`` (ONNX
        IR 8; a caller may leave it out) and an ``If`` on ``OptionalHasElement`` picks the fed value or a
        ``Constant`` default. Not an initializer of the input's name (the IR's other form of a default):
        onnxruntime logs a warning for every such initializer at every session creation (IR >= 4)."""
        if self._keep_input is None:
            onnx = _onnx()
            g, name, int64 = self.main, LOGITS_TO_KEEP, onnx.TensorProto.INT64
            scalar = onnx.helper.make_tensor_type_proto(int64, [])
            g.inputs.append(onnx.helper.make_value_info(name, onnx.helper.make_optional_type_proto(scalar)))
            fed, default = Graph(self, f"{name}_fed"), Graph(self, f"{name}_default")
            fed.outputs.append(onnx.helper.make_tensor_value_info(fed.node("OptionalGetElement", [name]), int64, []))
            default.outputs.append(onnx.helper.make_tensor_value_info(default.const(self.logits_to_keep, "int64"),
                                                                      int64, []))
            self._keep_input = g.node("If", [g.node("OptionalHasElement", [name])], then_branch=fed.make(),
                                      else_branch=default.make())
        return self._keep_input

    def _initializer(self, name: str, decl, parts: list[str] | None = None):
        """The initializer of parameter ``name`` (declaration ``decl``), or with ``parts`` (parameters of one
        float dtype, shapes ``[N_i, ...]``) the one of their arrays joined along axis 0."""
        onnx = _onnx()
        if parts is not None:
            decls = [self.module.params[n] for n in parts]
            shapes = [[int(d) for d in runtime_shape(d.type)] for d in decls]
            et = self.elem(decls[0].type.dtype)
            np_dt = onnx.helper.tensor_dtype_to_np_dtype(et)
            shape = [sum(s[0] for s in shapes), *shapes[0][1:]]

            def array(_name, _decl):
                return np.concatenate([np.asarray(self._array(n, d), dtype=np_dt).reshape(s)
                                       for n, d, s in zip(parts, decls, shapes)], axis=0)
        else:
            shape = [int(d) for d in runtime_shape(decl.type)]
            et = self.elem(decl.type.dtype)
            np_dt = onnx.helper.tensor_dtype_to_np_dtype(et)
            array = self._array
        if name in self._typed_params:                 # same bytes, typed FLOAT4E2M1 [E,N,K] / FLOAT8E8M0
            et, shape = self._typed_params[name], [int(d) for d in decl.type.shape]
            np_dt = np.uint8
        if self.weights == "external":       # data streamed to the side file, never held in the proto
            t = onnx.TensorProto(name=name, data_type=et, dims=shape)
            if name not in self._ext_index:    # functions exported into one file share the data
                arr = np.ascontiguousarray(array(name, decl), dtype=np_dt)
                off = self._ext.tell()
                pad = (-off) % 64
                self._ext.write(b"\0" * pad)
                self._ext.write(arr.tobytes())
                self._ext_index[name] = (off + pad, arr.nbytes)
            off, length = self._ext_index[name]
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", self._ext_name), ("offset", str(off)), ("length", str(length))):
                e = t.external_data.add()
                e.key, e.value = k, v
            return t
        if name in self._typed_params:
            t = onnx.TensorProto(name=name, data_type=et, dims=shape)
            t.raw_data = np.ascontiguousarray(array(name, decl), dtype=np.uint8).tobytes()
            return t
        arr = np.asarray(array(name, decl), dtype=np_dt).reshape(shape)
        return onnx.numpy_helper.from_array(arr, name)

    def _array(self, name: str, decl):
        if self.params is None:
            check_fits(8 * int(decl.type.numel()), f"random init of parameter {name}")
            if decl.attrs.get("source"):             # quantize-experts made it from a float parameter
                return self._quantized_init(name)
            return init_param(decl)
        a = self.params[name]
        if hasattr(a, "detach"):
            a = a.detach().cpu().float().numpy()
        return np.asarray(a)

    def _quantized_init(self, name: str):
        """Packed expert parameter ``name`` (or its scales) without bound weights: the quantisation of the random init
        of its float source, as ``runtime.params.init_params`` makes it (so the file computes what a Session on the
        same module computes), one expert tensor at a time."""
        from k3ir.passes.quantize_experts import is_derived, quantize_array

        from k3ir.ir import ParamDecl
        from k3ir.types import TensorType
        cache = self.__dict__.setdefault("_quantized", {})
        if name not in cache:
            for pname, pdecl in self.module.params.items():
                if is_derived(pdecl) and pdecl.attrs.get("role") != "scale" and name in (pname, pdecl.attrs["scale"]):
                    ftype = TensorType(pdecl.attrs.get("source_dtype", "bf16"), pdecl.type.shape)
                    src = init_param(ParamDecl(pdecl.attrs["source"], ftype))
                    cache[pname], cache[pdecl.attrs["scale"]] = quantize_array(pdecl.attrs["quant"], src)
                    break
            else:
                raise K3BackendError(f"ONNX export: parameter '{name}' is quantised but no packed parameter names it")
        return cache[name]

    def _standard_mxfp4_params(self, fn: Function) -> dict[str, int]:
        """Parameters read as MXFP4 codes / scales by ``k3.grouped_matmul`` in ``fn``: name -> FLOAT4E2M1 /
        FLOAT8E8M0 (the standard form of ``mxfp4_form="dequantize_linear"``)."""
        P = _onnx().TensorProto
        names = {id(op.results[0]): op.attrs["name"] for op in fn.ops if op.name == "k3.param"}
        out: dict[str, int] = {}
        for op in fn.ops:
            if op.name == "k3.grouped_matmul" and op.attrs.get("quant") == "mxfp4":
                for v, et in zip(op.operands[2:4], (P.FLOAT4E2M1, P.FLOAT8E8M0)):
                    if id(v) in names:
                        out[names[id(v)]] = et
        return out

    # ---- whole models ----------------------------------------------------------------
    def export_function(self, function: str = "prefill", external_path: str | None = None,
                        external_file=None):
        """An ``onnx.ModelProto`` for ``@function``. Inputs: the function's arguments (named as in
        the IR); outputs: ``logits`` then ``present.<state arg>`` per state. ``external_path``:
        side-file name (relative to the model) for ``weights="external"``; ``external_file`` an
        open binary file to append to (shared between functions)."""
        onnx = _onnx()
        if function not in self.module.functions:
            raise K3BackendError(f"module has no function '@{function}' (have: {', '.join(self.module.functions)})")
        fn = self.module.functions[function]
        self._param_names: dict[str, str] = {}
        self._used_params: list[str] = []
        self._typed_params = self._standard_mxfp4_params(fn) if self.mxfp4_form == "dequantize_linear" else {}
        self.native, self.fallback = {}, {}
        self.domains = set()
        self._keep_input = None
        self.main = g = Graph(self, f"{self.module.name}.{function}")
        opened = None
        if self.weights == "external":
            if external_path is None:
                raise K3BackendError("weights='external' needs an external data file name")
            self._ext_name = os.path.basename(external_path)
            self._ext = external_file if external_file is not None else open(external_path, "wb")  # noqa: SIM115
            opened = None if external_file is not None else self._ext
            if external_file is None:
                self._ext_index = {}
        try:
            names = []
            for a in fn.args:
                g.inputs.append(self.value_info(a.name, a.type))
                g.bind_dims(a.name, a.type)
                names.append(a.name)
            outs = self.emit_function(g, fn, names)
        finally:
            if opened is not None:
                opened.close()
        out_names = ["logits"] + [f"present.{a.name}" for a in fn.args[1:]]
        if len(out_names) != len(outs):
            out_names = [f"out{i}" for i in range(len(outs))]
        for name, src, v in zip(out_names, outs, fn.returns):
            g.nodes.append(onnx.helper.make_node("Identity", [src], [name]))
            info = self.value_info(name, v.type)
            dims = info.type.tensor_type.shape.dim
            if name == "logits" and self._keep_input is not None and len(dims) == 3 and dims[1].dim_param:
                dims[1].dim_param = "T_logits"                      # the kept positions, not T
            if name.startswith("present.") and isinstance(v.type, StateType):
                for d in dims:                                      # a cache grows by the new tokens: L + T
                    if d.dim_param == "L":
                        d.dim_param = self._grown_length(fn)
            g.outputs.append(info)
        opsets = [onnx.helper.make_opsetid("", self.opset)] + [onnx.helper.make_opsetid(d, 1) for d in sorted(self.domains)]
        model = onnx.helper.make_model(g.make(), opset_imports=opsets,
                                       producer_name="k3ir", producer_version="0.1.0")
        model.ir_version = 11 if self._typed_params else 10       # IR 11: FLOAT4E2M1 and FLOAT8E8M0
        meta = {"k3ir.function": function, "k3ir.opset": str(self.opset), "k3ir.module": self.module.name,
                "k3ir.native_ops": ",".join(sorted(self.native)),
                "k3ir.decomposed_ops": ",".join(sorted(self.fallback))}
        for k, v in meta.items():
            p = model.metadata_props.add()
            p.key, p.value = k, v
        return model


    @staticmethod
    def _grown_length(fn: Function) -> str:
        """The symbolic length of a ``present.*`` cache output: ``L_plus_T`` (``L`` cached plus ``T`` new
        tokens), ``L_plus_N`` where the token input's length is a static N (``L_plus_1`` for ``@decode``)."""
        t = fn.args[0].type if fn.args else None
        n = t.shape[1] if t is not None and not isinstance(t, StateType) and len(t.shape) >= 2 else "T"
        return f"L_plus_{n}"


def lowering_report(module: Module, function: str = "prefill", opset: int | None = None) -> dict[str, dict[str, int]]:
    """Which ops of ``@function`` the ONNX exporter lowers natively and which fall back to their
    decomposition: ``{"native": {op: count}, "decomposed": {op: count}}`` (structure only)."""
    x = OnnxExporter(module, weights="inputs", opset=opset)
    x.export_function(function)
    return {"native": dict(x.native), "decomposed": dict(x.fallback)}


def export_onnx(module: Module, path: str, function: str = "prefill", weights: str = "external",
                dtype: str = "float32", params: dict[str, Any] | None = None,
                opset: int | None = None, ort_kernels: bool = False, moe_form: str | None = None,
                mxfp4_form: str = "unpack", logits_to_keep: int = 1) -> dict[str, Any]:
    """Write ``@function`` of ``module`` to ``path`` (``.onnx``). ``weights="external"`` writes the
    data to ``<path>.data`` next to it; ``opset`` 27 or 20 (None: ``default_opset()``);
    ``ort_kernels``, ``moe_form``, ``mxfp4_form`` and ``logits_to_keep`` as in ``OnnxExporter``. Returns a summary (nodes, inputs, native/decomposed ops, opset)."""
    onnx = _onnx()
    x = OnnxExporter(module, dtype=dtype, weights=weights, params=params, opset=opset, ort_kernels=ort_kernels,
                     moe_form=moe_form, mxfp4_form=mxfp4_form, logits_to_keep=logits_to_keep)
    ext = path + ".data" if weights == "external" else None
    model = x.export_function(function, external_path=ext)
    if weights == "embedded" and model.ByteSize() > 2_000_000_000:
        raise K3BackendError("the model is over 2 GB: export with weights='external'")
    onnx.save_model(model, path)
    return {"path": path, "nodes": len(model.graph.node), "inputs": len(model.graph.input),
            "initializers": len(model.graph.initializer), "native": x.native, "decomposed": x.fallback,
            "external_data": ext, "params": list(x._used_params), "opset": x.opset}


def describe_io(module: Module, function: str = "prefill", opset: int | None = None,
                ort_kernels: bool = False, moe_form: str | None = None,
                mxfp4_form: str = "unpack", logits_to_keep: int = 1) -> list[tuple[str, str, str, list]]:
    """The interface of the exported ``@function``: ``(direction, name, element type, shape)`` for
    every graph input (``"input"``: token ids then one per state, zero-filled for a fresh
    sequence, then the optional ``logits_to_keep``, as its tensor's int64 ``[]``) and output (``"output"``:
    ``logits`` then ``present.<state>``), weights left out.
    Shapes use the IR's symbolic dims (``B`` batch, ``T`` new tokens, ``L`` cached tokens, ``L_plus_T`` the
    cache after the call, ``L_plus_1`` in ``@decode``); the
    other options as in ``OnnxExporter`` (they do not change the interface, but are checked the same way).
    Raises K3BackendError for a missing function or a bad option."""
    onnx = _onnx()
    model = OnnxExporter(module, weights="inputs", opset=opset, ort_kernels=ort_kernels, moe_form=moe_form,
                         mxfp4_form=mxfp4_form, logits_to_keep=logits_to_keep).export_function(function)
    weights = set(module.params)
    rows = []
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            if v.name in weights:
                continue
            t = v.type.optional_type.elem_type.tensor_type if v.type.HasField("optional_type") else v.type.tensor_type
            shape = [d.dim_param or d.dim_value for d in t.shape.dim]
            rows.append((kind, v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, shape))
    return rows
