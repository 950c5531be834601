"""The ``tvm`` target (alias ``tvm-llvm``): the fused IR lowered to Apache TVM Relax (``lower.py``,
``lower_model.py``, TE/TIR kernels in ``kernels.py``), compiled for ``llvm`` and run by the
Relax VM on this CPU through the usual ``Session`` API.

- One Relax function per entry function, compiled lazily on first use and cached per process
  (keyed by the printed IR, dtype and TVM target): batch, sequence length and MLA cache length
  are symbolic Relax shape variables, so a compiled function serves every shape (no
  re-compilation per shape).
- Linear layers and the per-expert GEMMs run as register-tiled, vectorised, parallel TIR kernels; a weight read
  only by them is stored as column panels (``cpu_gemm.py``: packed from the weights when a function first runs, the
  Relax parameter ``<name>#panels<NR>``), any other as declared, ``[N, K]``; KDA as a TIR recurrence kernel vectorised over value columns; MoE as dispatch (stable sort
  by expert) + one GEMM per expert over its sorted rows (MXFP4/INT4: dequantised in the register tile)
  + combine; MLA and AttnRes as Relax ops. Kernels are compiled for this machine's CPU
  (``TvmConfig.mcpu``).
  Ops without a native lowering fall back to their decomposition (``k3ir check --target tvm``).
- Cross targets ``tvm-cuda``, ``tvm-rocm``, ``tvm-vulkan``, ``tvm-metal``, ``tvm-opencl``,
  ``tvm-webgpu``, ``tvm-c``: registered so that ``k3ir check`` and ``k3ir backends`` know them;
  they do not run here. ``k3ir.backends.tvm.cross.emit_source(kind)`` builds a scheduled kernel
  for one of them and returns the generated device code (see ``cross.py``).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module

from .. import Backend, Executable, TargetDescription, register_backend
from .config import get_tvm_config
from .cross import register_cross_targets, tvm_missing

_COMPILED: dict[str, tuple[Any, dict[str, list[str]]]] = {}   # key -> (VMExecutable, {function: params})
#: entry functions compiled into one Relax module (they share most kernels: half the build time)
GROUPS = (("prefill", "decode"),)


def opt_level() -> int:
    """LLVM optimisation level: ``TvmConfig.opt_level`` (``K3IR_TVM_OPT_LEVEL``, 0-3, default 3). Level 0 builds
    about 3x faster with the same numerics (no fast-math at any level); the test suite uses it."""
    return get_tvm_config().opt_level


def llvm_target():
    """The ``llvm`` target of the CPU builds: ``TvmConfig.opt_level``, ``TvmConfig.mcpu`` (empty: this machine's
    CPU as LLVM names it) and this machine's core count (the parallel loops' thread pool). Raises
    ``K3ConfigError`` for an ``mcpu`` LLVM does not know (LLVM itself would warn and build for ``generic``)."""
    import os

    import tvm
    from tvm.target import codegen

    mcpu = get_tvm_config().mcpu
    if mcpu and not codegen.llvm_is_valid_cpu(mcpu, codegen.llvm_get_system_triple()):
        import difflib

        from k3ir.errors import K3ConfigError
        names = [str(c) for c in codegen.llvm_get_cpu_archlist(tvm.target.Target("llvm"))]
        near = difflib.get_close_matches(mcpu, names, n=3)
        raise K3ConfigError(f"TvmConfig.mcpu / K3IR_TVM_MCPU={mcpu!r}: not a CPU LLVM knows for "
                            f"{codegen.llvm_get_system_triple()}" + (f" (did you mean {', '.join(near)}?)" if near else "")
                            + "; e.g. x86-64-v2, x86-64-v3, znver4, sapphirerapids, or empty for this machine's CPU")
    mcpu = mcpu or codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "opt-level": opt_level(), "mcpu": mcpu,
                              "num-cores": len(os.sched_getaffinity(0))})


def configure_threads() -> int:
    """Threads of TVM's CPU thread pool, set before the first run: ``TvmConfig.num_threads``, or with 0 (default) the
    CPUs this process may run on (``os.sched_getaffinity``). TVM sizes a thread's pool when that thread first runs a
    parallel kernel, from ``TVM_NUM_THREADS`` (then ``OMP_NUM_THREADS``), else half the hardware threads on x86 (it
    assumes two per core: one thread on a 2-core machine, half the CPU for every kernel). So this sets
    ``TVM_NUM_THREADS`` unless the user has. Returns the count in effect."""
    import os
    have = os.environ.get("TVM_NUM_THREADS")
    if have is None:
        n = get_tvm_config().num_threads          # an integer >= 0: the config checks it (K3ConfigError)
        have = str(n or len(os.sched_getaffinity(0)))
        os.environ["TVM_NUM_THREADS"] = have
    return int(have) if have.isdigit() else 0


#: x86 SIMD extensions an llvm build for this host's CPU may use; an artifact records those of its build host
#: and refuses to load where one is missing (the kernels would die with SIGILL)
SIMD_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd", "avx512bw",
              "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


def host_simd_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The ``SIMD_FLAGS`` this machine's CPU has (from ``cpuinfo``'s first ``flags`` line), or None where the file
    is not there or has no flags line (not Linux, not x86): then nothing is recorded or checked."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in SIMD_FLAGS if x in have]
    except OSError:
        return None
    return None


def check_simd_flags(man: dict, directory: str, cpuinfo: str = "/proc/cpuinfo") -> None:
    """Raise ``K3RuntimeError`` when the artifact in ``directory`` was built for its build host's CPU (manifest
    ``simd_flags``, written when ``TvmConfig.mcpu`` is empty) and this CPU lacks one of those extensions, or when
    ``simd_flags`` is not a list of names."""
    from k3ir.errors import K3RuntimeError
    need = man.get("simd_flags")
    if need is not None and not (isinstance(need, list) and all(isinstance(x, str) for x in need)):
        raise K3RuntimeError(f"{directory}/manifest.json: 'simd_flags' must be a list of CPU flag names, "
                             f"got {json.dumps(need)[:80]}")
    have = host_simd_flags(cpuinfo)
    if not need or have is None:
        return
    missing = [x for x in need if x not in have]
    if missing:
        raise K3RuntimeError(
            f"{directory}: the TVM libraries were compiled for a CPU ({man.get('mcpu', '?')}) with "
            f"{', '.join(missing)}, which this CPU lacks; rebuild the artifact on this machine, or build it for a "
            f"common CPU with K3IR_TVM_MCPU (e.g. x86-64-v2) (docs/config.md)")


def _np(a, dtype=None) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(dtype) if dtype is not None and a.dtype != dtype else a


def _tvm_tensor(a: np.ndarray):
    """``a`` as a ``tvm.runtime.Tensor``: without a copy when it is C-contiguous, writable and 64-byte aligned (the
    kernels' buffers are declared 64-byte aligned: every array ``run`` returned, e.g. the states fed back each decode
    step), else a copy."""
    import tvm
    if a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0 and a.size:
        return tvm.runtime.from_dlpack(a)
    return tvm.runtime.tensor(np.ascontiguousarray(a))


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
        self._loaded: dict[str, tuple[Any, dict[str, list[str]]]] = {}   # group key -> (library, names)
        self._arrays: dict[str, np.ndarray] | None = None
        self.weights_inside = False
        #: seconds the lowering + LLVM build of each function group took in this executable ("prefill+decode"
        #: -> s); near 0 for a group compiled before in this process or loaded from an artifact
        self.build_seconds: dict[str, float] = {}

    def _group(self, function: str) -> list[str]:
        for g in GROUPS:
            if function in g:
                return [f for f in g if f in self.module.functions]
        return [function]

    def _key(self, functions: list[str]) -> str:
        from k3ir.printer import print_function
        text = "\n".join(print_function(self.module.functions[f]) for f in functions)
        decls = "|".join(f"{n}:{d.type}" for n, d in sorted(self.module.params.items()))
        cfg = get_tvm_config()                    # the configured switches (mcpu empty: this host), no codegen call
        return hashlib.sha256(f"{self.dtype} {cfg}\n{text}\n{decls}".encode()).hexdigest()

    def compile(self, function: str):
        """(Relax VM, parameter names) of ``function``, compiling on first use."""
        if function in self._vms:
            return self._vms[function]
        if function not in self.module.functions:
            raise K3BackendError(f"module has no function '@{function}'")
        from k3ir.progress import progress
        group = self._group(function)
        label = "+".join(group)
        with progress(f"tvm: lowering and building @{label.replace('+', ' @')} for llvm "
                      f"(opt-level {opt_level()})") as timing:       # the tvm import included (seconds when cold)
            import tvm
            from tvm.runtime.vm import VirtualMachine  # the runtime's VM: loads with TVM_USE_RUNTIME_LIB=1 too
            key = self._key(group)
            if key not in _COMPILED and key in self._loaded:
                _COMPILED[key] = self._loaded[key]
            if key not in _COMPILED:
                from .lower import build_relax
                mod, params = build_relax(self.module, group, self.dtype)
                _COMPILED[key] = (tvm.compile(mod, target=llvm_target()), params)
            ex, names = _COMPILED[key]
            # the naive allocator frees each buffer when the VM drops it; the default pooled one keeps every freed
            # buffer for reuse at its exact (page-rounded) size, so a prefill in segments (cache length S growing
            # each call) kept one set of S-sized buffers per segment: memory grew with the square of the prompt
            # (k3-tiny engine: +1.1 GB at 64k tokens; bench/SERVING.md). Same speed here within noise.
            configure_threads()
            vm = VirtualMachine(ex, tvm.cpu(), memory_cfg="naive")
        self.build_seconds[label] = timing.seconds
        for f in group:
            self._vms[f] = (vm[f], names[f])
        return self._vms[function]

    def build_all(self) -> dict[str, float]:
        """Compile every entry function now (they compile lazily on first use otherwise); returns
        ``build_seconds``: function group ("prefill+decode", "forward") -> seconds this build took."""
        for fn in ("forward", "prefill", "decode"):
            if fn in self.module.functions:
                self.compile(fn)
        return dict(self.build_seconds)

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        if self.weights_inside and not arrays:
            arrays = self._arrays or {}
        else:
            self.weights_inside = False
        self._arrays = {k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v))
                        for k, v in arrays.items()}
        return {name: self._tensor(name, a) for name, a in arrays.items()}

    def _tensor(self, name: str, a):
        """Parameter ``name``'s array ``a`` as the functions take it: floats in the compile dtype, packed MXFP4 ``u8``
        and INT4 ``i32`` as they are, integers int64."""
        import tvm
        decl = self.module.params.get(name)
        dt = decl.type.dtype if decl is not None else "f32"
        want = {"mxfp4": np.uint8, "int4": np.int32, "u8": np.uint8, "i64": np.int64,
                "i32": np.int64}.get(dt, self.dtype)
        return tvm.runtime.tensor(np.ascontiguousarray(_np(a, want)))

    def _param(self, params: dict[str, Any], name: str):
        """``params[name]``. A weight the functions read as panels (``cpu_gemm.panel_name``: the lowering's
        choice, listed in an artifact's manifest) is packed on first use from the prepared weights
        (``cpu_gemm.pack_panels``) and kept in ``params``, where it replaces the plain weight once no compiled
        function reads that; a plain weight dropped so is made again from the prepared weights when one does."""
        t = params.get(name)
        if t is not None:
            return t
        import tvm

        from .panels import pack_panels, panel_source
        src = panel_source(name)
        base = src[0] if src else name
        a = self._arrays.get(base) if self._arrays is not None else None
        if a is None:
            if base not in params:
                raise K3BackendError(f"tvm executable: no weight '{base}' among the parameters (for '{name}')")
            a = params[base].numpy()
        if src is None:
            t = self._tensor(name, a)
        else:
            a = _np(a, self.dtype)
            t = tvm.runtime.tensor(pack_panels(a.reshape(-1, a.shape[-1]), src[1]))
            if base in params and base in (self._arrays or {}) and not any(base in names for _, names in self._vms.values()):
                del params[base]
        params[name] = t
        return t

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        from k3ir.types import TensorType
        fn, names = self.compile(function)
        targs = []
        for a, spec in zip(args, self.module.functions[function].args):
            ints = isinstance(spec.type, TensorType) and spec.type.dtype in ("i64", "i32")
            targs.append(_tvm_tensor(_np(a, np.int64 if ints else self.dtype)))
        res = fn(*targs, *[self._param(params, n) for n in names])
        outs = list(res) if not hasattr(res, "numpy") else [res]
        return [np.from_dlpack(o) for o in outs]       # views of the VM's results: the states are not copied

    def to_numpy(self, x: Any):
        return np.asarray(x)

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Write the artifact: one shared library per function group (``tvm_<group>.so``, built
        with ``export_library``), ``weights.safetensors``, ``module.k3`` and ``manifest.json``.
        ``params`` defaults to the prepared weights. Returns the directory."""
        import os

        from safetensors.numpy import save_file

        from ..artifact import write_manifest
        params = params if params is not None else self._arrays
        if params is None:
            raise K3BackendError("tvm executable: no weights to save (pass params or call prepare_params)")
        os.makedirs(directory, exist_ok=True)
        files: dict[str, str] = {}
        groups = []
        for fn in ("forward", "prefill", "decode"):
            if fn not in self.module.functions:
                continue
            g = self._group(fn)
            if any(x in groups for x in g):
                continue
            self.compile(fn)
            ex, names = _COMPILED[self._key(g)]
            lib = f"tvm_{'_'.join(g)}.so"
            ex.export_library(os.path.join(directory, lib))
            files["|".join(g)] = lib
            groups.extend(g)
            files["names:" + "|".join(g)] = json.dumps(names)
        arrays = {}
        for k, a in params.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            arrays[k] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)
        save_file(arrays, os.path.join(directory, "weights.safetensors"))
        files["weights"] = "weights.safetensors"
        extra = {} if get_tvm_config().mcpu else {"simd_flags": host_simd_flags()}   # built for this host's CPU
        write_manifest(directory, self.module, "tvm", self.dtype, files, opt_level=opt_level(),
                       mcpu=str(llvm_target().attrs["mcpu"]), **extra)
        return directory


def load_executable(directory: str, man: dict, module: Module) -> TVMExecutable:
    """Reopen an artifact written by ``TVMExecutable.save`` from its checked manifest ``man`` and IR ``module``
    (``artifact.read_manifest``): ``tvm.runtime.load_module`` of each library, no lowering and no
    compilation. The libraries are native code (docs/artifacts.md); one built for its build host's CPU is refused,
    with a ``K3RuntimeError``, where this CPU lacks a SIMD extension it may use (``check_simd_flags``)."""
    import tvm
    from safetensors.numpy import load_file

    from ..artifact import artifact_file
    check_simd_flags(man, directory)
    exe = TVMExecutable(module, man["dtype"], "cpu")
    files = man["files"]
    for key in files:
        if key.startswith("names:") or key == "weights":
            continue
        group = key.split("|")
        names = json.loads(files["names:" + key])
        exe._loaded[exe._key(group)] = (tvm.runtime.load_module(artifact_file(directory, man, key)), names)
    exe._arrays = load_file(artifact_file(directory, man, "weights"))
    exe.weights_inside = True
    return exe


def _build(module: Module, dtype: str = "float32", device: str = "cpu") -> TVMExecutable:
    if dtype not in ("float32", "float64"):
        dtype = "float32"     # bf16/f16 requests compute in float32 on the CPU
    return TVMExecutable(module, dtype, device)


def _table():
    from .lower import TABLE
    return TABLE


def _function_problem(module: Module, name: str) -> str | None:
    from .lower import function_problem
    return function_problem(module, name)


def _pipeline() -> list[str]:
    from k3ir.passes.pipelines import pipeline_for
    return pipeline_for("tvm")


register_backend(Backend(name="tvm", description="Apache TVM Relax, compiled for llvm (this CPU)",
                         build=_build, pipeline=_pipeline(), table=_table, aliases=("tvm-llvm",),
                         function_support=_function_problem, available=tvm_missing, dtypes=("float32", "float64"), load_artifact=load_executable,
                         target_description=TargetDescription(kind="llvm", toolchain="Apache TVM Relax/TIR (tvm.compile), LLVM codegen for this CPU")))

register_cross_targets()
