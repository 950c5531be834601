"""The ``mlir`` target: emit linalg/tensor/func MLIR (``emit.py``, lowering table in
``lowering.py``), parse and verify it with the IREE compiler's MLIR bindings, compile it with IREE
(``llvm-cpu`` for the host; ``rocm``, ``vulkan-spirv``, ``metal-spirv`` offline) and run it with
the IREE runtime. Weights are trailing function arguments held as IREE device arrays.
``save(dir)`` writes ``k3.vmfb`` + ``weights.safetensors``; ``load_executable`` (the backend's
``load_artifact``) reopens it without recompiling (``Session.load``)."""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module

from .. import Backend, Executable, register_backend

log = logging.getLogger("k3ir.mlir")

#: ``--iree-target`` name -> (IREE target backend, extra compiler flags)
IREE_TARGETS: dict[str, tuple[str, list[str]]] = {
    "llvm-cpu": ("llvm-cpu", ["--iree-llvmcpu-target-cpu=host"]),
    "llvm-cpu-generic": ("llvm-cpu", ["--iree-llvmcpu-target-cpu=generic"]),
    "rocm": ("rocm", ["--iree-rocm-target=gfx942"]),          # IREE 3.13 spelling (MI300)
    "vulkan-spirv": ("vulkan-spirv", ["--iree-vulkan-target=rdna3"]),
    "metal-spirv": ("metal-spirv", ["--iree-metal-target-platform=macos"]),
}
#: functions compiled together (decode and prefill share one module; forward is built on demand)
GROUPS = (("prefill", "decode"), ("forward",))


def _iree_compiler():
    try:
        import iree.compiler as ic
    except ImportError as e:  # pragma: no cover
        raise K3BackendError("target 'mlir' needs the IREE compiler (pip install 'k3ir[mlir]')") from e
    return ic


def _iree_runtime():
    try:
        import iree.runtime as rt
    except ImportError as e:  # pragma: no cover
        raise K3BackendError("target 'mlir' needs the IREE runtime (pip install 'k3ir[mlir]')") from e
    return rt


def emit_mlir(module: Module, functions: list[str] | tuple[str, ...],
              weights: str | None = None) -> tuple[str, dict[str, list[str]]]:
    """MLIR text for ``functions`` (one ``module @k3``) and, per function, the parameter names in
    the order of its trailing weight arguments. ``weights``: ``"f32"`` or ``"bf16"`` (the bf16-declared
    parameters as bf16 arguments), None: ``MlirConfig.weights``. The text is parsed and verified with IREE's
    MLIR bindings; raises K3BackendError on an invalid module."""
    from .emit import MlirEmitter
    em = MlirEmitter(module, weights=weights)
    text = em.module_text(list(functions))
    verify_mlir(text)
    return text, em.param_order


def verify_mlir(text: str) -> None:
    """Parse and verify MLIR text with ``iree.compiler.ir``; raises K3BackendError."""
    ic = _iree_compiler()
    from iree.compiler import ir
    del ic
    try:
        with ir.Context() as ctx:
            m = ir.Module.parse(text, ctx)
            if not m.operation.verify():
                raise K3BackendError("emitted MLIR does not verify")
    except ir.MLIRError as e:
        raise K3BackendError(f"emitted MLIR is invalid: {e}") from None


def compile_mlir(text: str, iree_target: str = "llvm-cpu") -> bytes:
    """IREE ``.vmfb`` bytes for MLIR ``text``; ``iree_target`` is a key of ``IREE_TARGETS``.
    Compiled modules are cached under ``MlirConfig.cache``/iree (``K3IR_CACHE``, default ``~/.cache/k3ir``), keyed by
    the text, target, flags and IREE version. Raises K3BackendError."""
    ic = _iree_compiler()
    if iree_target not in IREE_TARGETS:
        raise K3BackendError(f"unknown IREE target '{iree_target}' (want one of {', '.join(IREE_TARGETS)})")
    backend, flags = IREE_TARGETS[iree_target]
    import hashlib
    from importlib.metadata import version
    key = hashlib.sha256("\0".join([text, backend, *flags, version("iree-base-compiler")]).encode()).hexdigest()
    from .config import get_mlir_config
    cache = get_mlir_config().cache_dir()
    path = os.path.join(cache, "iree", f"{key}.vmfb")
    if os.path.isfile(path):                  # same MLIR, target, flags and IREE: reuse the module
        with open(path, "rb") as f:
            return f.read()
    from k3ir.progress import progress
    try:
        with progress(f"IREE: compiling {len(text.splitlines()):,} lines of MLIR for {iree_target}"):
            data = ic.compile_str(text, target_backends=[backend], extra_args=flags)
    except ic.CompilerToolError as e:
        msg = [ln for ln in str(e).strip().splitlines() if "error" in ln.lower()] or str(e).strip().splitlines()
        raise K3BackendError(f"IREE could not compile for {iree_target}: {msg[0] if msg else e}") from None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:                       # a read-only home is not an error
        log.debug("IREE module cache not written: %s", e)
    return data


class MlirExecutable(Executable):
    """Runs entry functions as IREE functions on the ``local-task`` CPU driver (float32 compute). ``weights``
    (``MlirConfig.weights`` when built, kept for its lifetime): ``"bf16"`` passes the parameters the IR declares
    bf16 as bf16 arrays (float values rounded to bf16 once, in ``prepare_params``)."""

    def __init__(self, module: Module, dtype: str = "float32", device: str = "cpu"):
        if dtype != "float32":
            raise K3BackendError(f"target 'mlir' runs float32, not '{dtype}'")
        if device != "cpu":
            raise K3BackendError(f"target 'mlir' runs on the CPU (IREE llvm-cpu), not '{device}'")
        super().__init__(module, "mlir", dtype, device)
        rt = _iree_runtime()
        from .config import get_mlir_config
        self.weights = get_mlir_config().weights
        self.config = rt.Config("local-task")
        self.vmfb: dict[tuple[str, ...], bytes] = {}
        self.param_order: dict[str, list[str]] = {}
        self._modules: dict[str, Any] = {}
        self._arrays: dict[str, np.ndarray] | None = None
        self._device_params: dict[str, Any] = {}
        self.weights_inside = False
        #: seconds emitting + IREE-compiling each function group took ("prefill+decode" -> s; a module found in
        #: the IREE cache takes well under a second)
        self.build_seconds: dict[str, float] = {}

    def _group(self, function: str) -> tuple[str, ...]:
        for g in GROUPS:
            if function in g:
                return tuple(f for f in g if f in self.module.functions)
        return (function,)

    def compile_group(self, group: tuple[str, ...]) -> bytes:
        """The llvm-cpu ``.vmfb`` of ``group`` (emitted and compiled on first use; time in ``build_seconds``)."""
        if group not in self.vmfb:
            from k3ir.progress import progress
            with progress(f"mlir: emitting and compiling @{' @'.join(group)} with IREE (llvm-cpu)") as timing:
                text, order = emit_mlir(self.module, group, weights=self.weights)
                self.param_order.update(order)
                self.vmfb[group] = compile_mlir(text, "llvm-cpu")
            self.build_seconds["+".join(group)] = timing.seconds
        return self.vmfb[group]

    def build_all(self) -> dict[str, float]:
        """Compile every entry function now (otherwise on first use); returns ``build_seconds``."""
        for g in GROUPS:
            group = tuple(f for f in g if f in self.module.functions)
            if group:
                self.compile_group(group)
        return dict(self.build_seconds)

    def _load_group(self, group: tuple[str, ...]) -> None:
        rt = _iree_runtime()
        ctx = rt.SystemContext(config=self.config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, self.compile_group(group)))
        for f in group:
            self._modules[f] = ctx.modules.k3[f]

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        if self.weights_inside and not arrays:
            arrays = self._arrays or {}
        else:
            self.weights_inside = False
        rt = _iree_runtime()
        bf16 = _bf16_params(self.module) if self.weights == "bf16" else set()
        packed = {n: [int(x) for x in d.type.shape] for n, d in self.module.params.items() if d.type.dtype == "mxfp4"}
        out = {}
        for k, a in arrays.items():
            if hasattr(a, "detach"):
                a = a.detach().float().cpu().numpy() if str(a.dtype) == "torch.bfloat16" else a.detach().cpu().numpy()
            a = np.asarray(a)
            if k in packed:                       # the stored bytes as i4 codes [..., K] (two a byte, low first)
                out[k] = _i4_view(rt, self.config.device, a, packed[k])
                continue
            if k in bf16:
                import ml_dtypes  # a dependency of iree-base-runtime
                a = a.astype(np.float32).astype(ml_dtypes.bfloat16)
            elif a.dtype.kind == "f":
                a = a.astype(np.float32)
            out[k] = rt.asdevicearray(self.config.device, np.ascontiguousarray(a))
        self._arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self._device_params = out
        return out

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        if function not in self._modules:
            self._load_group(self._group(function))
        fn = self._modules[function]
        spec = self.module.functions[function].args
        ins = []
        for a, s in zip(args, spec):
            if hasattr(a, "detach"):
                a = a.detach().cpu().numpy()
            a = np.asarray(a)
            want = np.int64 if getattr(s.type, "dtype", "f32") in ("i64", "i32") else np.float32
            ins.append(np.ascontiguousarray(a.astype(want, copy=False)))
        p = params or self._device_params
        ins += [p[n] for n in self.param_order[function]]
        outs = fn(*ins)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        return [np.asarray(o.to_host() if hasattr(o, "to_host") else o) for o in outs]

    def to_numpy(self, x: Any):
        return np.asarray(x)

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Write ``k3.vmfb`` (all entry functions, llvm-cpu), ``module.mlir``, ``weights.safetensors``,
        ``module.k3`` and ``manifest.json``. Returns the directory."""
        from safetensors.numpy import save_file

        from ..artifact import write_manifest
        from .config import get_mlir_config
        params = params if params is not None else self._arrays
        if params is None:
            raise K3BackendError("mlir executable: no weights to save (pass params or call prepare_params)")
        os.makedirs(directory, exist_ok=True)
        fns = tuple(f for f in ("forward", "prefill", "decode") if f in self.module.functions)
        text, order = emit_mlir(self.module, fns, weights=self.weights)
        with open(os.path.join(directory, "module.mlir"), "w") as f:
            f.write(text)
        with open(os.path.join(directory, "k3.vmfb"), "wb") as f:
            f.write(compile_mlir(text, "llvm-cpu"))
        arrays = {}
        for k, a in params.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            arrays[k] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)
        save_file(arrays, os.path.join(directory, "weights.safetensors"))
        write_manifest(directory, self.module, "mlir", self.dtype,
                       {"vmfb": "k3.vmfb", "mlir": "module.mlir", "weights": "weights.safetensors"},
                       functions=list(fns), param_order=order, iree_target="llvm-cpu", weights=self.weights,
                       logits_to_keep=get_mlir_config().logits_to_keep)   # compiled in: [B,1,V] prefill logits if 1
        return directory


def load_executable(directory: str, man: dict, module: Module) -> MlirExecutable:
    """Reopen an artifact written by ``MlirExecutable.save`` from its checked manifest ``man`` and IR ``module``
    (``artifact.read_manifest``): no MLIR emission, no compilation. The ``.vmfb`` holds native code
    (docs/artifacts.md)."""
    from safetensors.numpy import load_file

    from ..artifact import artifact_file
    exe = MlirExecutable(module, man["dtype"])
    exe.weights = man.get("weights", "f32")                # the argument types the module was compiled with
    with open(artifact_file(directory, man, "vmfb"), "rb") as f:
        vmfb = f.read()
    fns = tuple(man["functions"])
    exe.param_order = {k: list(v) for k, v in man["param_order"].items()}
    rt = _iree_runtime()
    ctx = rt.SystemContext(config=exe.config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    for f in fns:
        exe._modules[f] = ctx.modules.k3[f]
    exe._arrays = load_file(artifact_file(directory, man, "weights"))
    exe.weights_inside = True
    return exe


def _i4_view(rt, device, a: np.ndarray, shape: list[int]):
    """A device buffer view ``i4[shape]`` over packed MXFP4 bytes ``a`` (``u8[..., K/2]``, low nibble = even column,
    the order IREE packs i4 in). Raises K3BackendError when the byte count does not fit ``shape``."""
    a = np.ascontiguousarray(np.asarray(a).astype(np.uint8, copy=False))
    if a.size * 2 != int(np.prod(shape)):
        raise K3BackendError(f"packed MXFP4 weights of {a.size} bytes do not fit mxfp4{shape} (want {np.prod(shape) // 2})")
    buf = device.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                allowed_usage=rt.BufferUsage.DEFAULT, device=device, buffer=a)
    return rt.HalBufferView(buf, shape, rt.HalElementType.INT_4)


def _bf16_params(module: Module) -> set[str]:
    """Parameters the IR declares bf16 (bf16 arguments under ``MlirConfig.weights="bf16"``)."""
    return {n for n, d in module.params.items() if d.type.dtype == "bf16"}


def _build(module: Module, dtype: str = "float32", device: str = "cpu") -> MlirExecutable:
    return MlirExecutable(module, dtype, device)


def _table():
    from . import contract, kda, moe  # noqa: F401  (their entries register into TABLE)
    from .lowering import TABLE
    return TABLE


def _available() -> str | None:
    import importlib.util
    for pkg, pip in (("iree.compiler", "iree-base-compiler"), ("iree.runtime", "iree-base-runtime")):
        try:
            if importlib.util.find_spec(pkg) is None:
                return f"{pip} is not installed (pip install 'k3ir[mlir]')"
        except ModuleNotFoundError:
            return f"{pip} is not installed (pip install 'k3ir[mlir]')"
    return None


register_backend(Backend(name="mlir", description="linalg/tensor MLIR compiled and run by IREE (llvm-cpu)",
                         build=_build, pipeline=["dce"], table=_table, aliases=("iree",),
                         available=_available, functions=("forward", "prefill", "decode"), dtypes=("float32",),
                         load_artifact=load_executable))
