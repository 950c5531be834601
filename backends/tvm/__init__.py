"""The ``tvm`` target (alias ``tvm-llvm``): the fused IR lowered to Apache TVM Relax (``lower.py``,
``lower_model.py``, TE/TIR kernels in ``kernels.py``), compiled for ``llvm`` and run by the
Relax VM on this CPU through the usual ``Session`` API.

- One Relax function per entry function, compiled lazily on first use and cached per process
  (keyed by the printed IR, dtype and TVM target): batch, sequence length and MLA cache length
  are symbolic Relax shape variables, so a compiled function serves every shape (no
  re-compilation per shape).
- KDA runs as a TIR recurrence kernel; MoE as dispatch (stable sort by expert) + a gather-GEMM
  over sorted rows (MXFP4/INT4 dequantised inside) + combine; MLA and AttnRes as Relax ops.
  Ops without a native lowering fall back to their decomposition (``k3ir check --target tvm``).
- Cross targets ``tvm-cuda``, ``tvm-rocm``, ``tvm-vulkan``, ``tvm-metal``, ``tvm-opencl``,
  ``tvm-webgpu``, ``tvm-c``: registered so that ``k3ir check`` and ``k3ir backends`` know them;
  they do not run here. ``k3ir.backends.tvm.cross.emit_source(kind)`` builds a scheduled kernel
  for one of them and returns the generated device code (see ``cross.py``).
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module

from .. import Backend, Executable, register_backend

_COMPILED: dict[str, tuple[Any, dict[str, list[str]]]] = {}   # key -> (VMExecutable, {function: params})
#: entry functions compiled into one Relax module (they share most kernels: half the build time)
GROUPS = (("prefill", "decode"),)


def opt_level() -> int:
    """LLVM optimisation level: ``K3IR_TVM_OPT_LEVEL`` (0-3, default 3). Level 0 builds about 3x
    faster with the same numerics (no fast-math at any level); the test suite uses it."""
    import os
    try:
        return min(3, max(0, int(os.environ.get("K3IR_TVM_OPT_LEVEL", "3"))))
    except ValueError:
        return 3


def _available() -> str | None:
    import importlib.util
    if importlib.util.find_spec("tvm") is None:
        return "apache-tvm is not installed (pip install 'k3ir[tvm]')"
    return None


def _np(a, dtype=None) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(dtype) if dtype is not None and a.dtype != dtype else a


class TVMExecutable(Executable):
    """Relax VM functions compiled for ``llvm``; parameters are ``tvm.runtime.Tensor`` values
    (float params in the compile dtype, packed MXFP4 ``u8`` / INT4 ``i32`` kept packed).
    ``run`` returns NumPy arrays (logits, then the new states)."""

    def __init__(self, module: Module, dtype: str = "float32", device: str = "cpu"):
        if dtype not in ("float32", "float64"):
            raise K3BackendError(f"target 'tvm' computes in float32 or float64, not '{dtype}'")
        if device != "cpu":
            raise K3BackendError(f"target 'tvm' runs on the CPU (llvm); '{device}' is a cross target only")
        super().__init__(module, "tvm", dtype, device)
        self._vms: dict[str, tuple[Any, list[str]]] = {}

    def _group(self, function: str) -> list[str]:
        for g in GROUPS:
            if function in g:
                return [f for f in g if f in self.module.functions]
        return [function]

    def _key(self, functions: list[str]) -> str:
        from k3ir.printer import print_function
        text = "\n".join(print_function(self.module.functions[f]) for f in functions)
        decls = "|".join(f"{n}:{d.type}" for n, d in sorted(self.module.params.items()))
        return hashlib.sha256(f"{self.dtype} {opt_level()}\n{text}\n{decls}".encode()).hexdigest()

    def compile(self, function: str):
        """(Relax VM, parameter names) of ``function``, compiling on first use."""
        if function in self._vms:
            return self._vms[function]
        if function not in self.module.functions:
            raise K3BackendError(f"module has no function '@{function}'")
        import tvm
        from tvm import relax
        group = self._group(function)
        key = self._key(group)
        if key not in _COMPILED:
            from .lower import build_relax
            mod, params = build_relax(self.module, group, self.dtype)
            target = tvm.target.Target({"kind": "llvm", "opt-level": opt_level()})
            _COMPILED[key] = (tvm.compile(mod, target=target), params)
        ex, names = _COMPILED[key]
        vm = relax.VirtualMachine(ex, tvm.cpu())
        for f in group:
            self._vms[f] = (vm[f], names[f])
        return self._vms[function]

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        import tvm
        out = {}
        for name, a in arrays.items():
            decl = self.module.params.get(name)
            dt = decl.type.dtype if decl is not None else "f32"
            want = {"mxfp4": np.uint8, "int4": np.int32, "u8": np.uint8, "i64": np.int64,
                    "i32": np.int64}.get(dt, self.dtype)
            out[name] = tvm.runtime.tensor(np.ascontiguousarray(_np(a, want)))
        return out

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        import tvm

        from k3ir.types import TensorType
        fn, names = self.compile(function)
        targs = []
        for a, spec in zip(args, self.module.functions[function].args):
            ints = isinstance(spec.type, TensorType) and spec.type.dtype in ("i64", "i32")
            targs.append(tvm.runtime.tensor(np.ascontiguousarray(_np(a, np.int64 if ints else self.dtype))))
        res = fn(*targs, *[params[n] for n in names])
        outs = list(res) if not hasattr(res, "numpy") else [res]
        return [o.numpy() for o in outs]

    def to_numpy(self, x: Any):
        return np.asarray(x)


def _build(module: Module, dtype: str = "float32", device: str = "cpu") -> TVMExecutable:
    if dtype not in ("float32", "float64"):
        dtype = "float32"     # bf16/f16 requests compute in float32 on the CPU
    return TVMExecutable(module, dtype, device)


def _lowers() -> set[str]:
    from .lower import TABLE
    return set(TABLE)


def _pipeline() -> list[str]:
    from k3ir.passes.pipelines import pipeline_for
    return pipeline_for("tvm")


register_backend(Backend(name="tvm", description="Apache TVM Relax, compiled for llvm (this CPU)",
                         build=_build, pipeline=_pipeline(), lowers=_lowers, aliases=("tvm-llvm",),
                         available=_available))

from .cross import register_cross_targets

register_cross_targets()
