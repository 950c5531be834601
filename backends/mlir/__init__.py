"""The ``mlir`` target: emit linalg/tensor/func MLIR (``emit.py``, lowering table in
``lowering.py``), parse and verify it with the IREE compiler's MLIR bindings, compile it with IREE
(``llvm-cpu`` for the host; ``rocm``, ``vulkan-spirv``, ``metal-spirv`` offline) and run it with
the IREE runtime. Weights are IREE parameters bound when the module loads (``MlirConfig.param_form="globals"``,
the default: one ``util.global`` each, which IREE packs into its matmul layout once) or trailing function arguments held as
IREE device arrays (``"arguments"``).
``save(dir)`` writes ``k3.vmfb`` + ``weights.safetensors``; ``load_executable`` (the backend's
``load_artifact``) reopens it without recompiling (``Session.load``)."""
from __future__ import annotations

import dataclasses
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
#: llvm-cpu flags of ``MlirConfig.data_tiling``: data tiling (matmul operands packed into the CPU's tile layout),
#: the mmt4d microkernel on the packed tiles, and 64 KiB of stack per dispatch (IREE's default 32 KiB is too little
#: for some data-tiled contractions, e.g. 48 KiB for the slices of k3-tiny's widened bf16 MLA weight; the task
#: workers' stacks are 128 KiB)
DATA_TILING_FLAGS = ["--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all",
                     "--iree-llvmcpu-stack-allocation-limit=65536"]
#: the IREE parameter scope of the weights under ``MlirConfig.param_form="globals"`` (``#flow.parameter.named``)
PARAM_SCOPE = "k3"
#: functions compiled together (decode and prefill share one module; forward is built on demand)
GROUPS = (("prefill", "decode"), ("forward",))
#: the groups under ``MlirConfig.data_tiling``: decode in a module of its own compiled without data tiling (IREE
#: 3.13's data tiling does not compile k3 decode steps: a per-head norm feeding the output projection over a
#: dynamic batch, "all stack allocations need to be hoisted to the entry block"; MLA's attention over the cache,
#: "exceeded stack allocation limit"), prefill and forward with it
DATA_TILED_GROUPS = (("prefill",), ("decode",), ("forward",))


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
              weights: str | None = None, param_form: str | None = None) -> tuple[str, dict[str, list[str]]]:
    """MLIR text for ``functions`` (one ``module @k3``) and, per function, the parameter names in
    the order of its weight values ``%p<i>`` (its trailing arguments under ``param_form="arguments"``).
    ``weights``: ``"f32"`` or ``"bf16"`` (the bf16-declared parameters as bf16), None: ``MlirConfig.weights``;
    ``param_form``: ``"globals"`` or ``"arguments"``, None: ``MlirConfig.param_form``. The text is parsed and
    verified with IREE's MLIR bindings; raises K3BackendError on an invalid module."""
    from .emit import MlirEmitter
    em = MlirEmitter(module, weights=weights, param_form=param_form)
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


def compile_mlir(text: str, iree_target: str = "llvm-cpu", data_tiling: bool | None = None) -> bytes:
    """IREE ``.vmfb`` bytes for MLIR ``text``; ``iree_target`` is a key of ``IREE_TARGETS``; ``data_tiling``
    (llvm-cpu targets: ``DATA_TILING_FLAGS``), None: ``MlirConfig.data_tiling``.
    Compiled modules are cached under ``MlirConfig.cache``/iree (``K3IR_CACHE``, default ``~/.cache/k3ir``), keyed by
    the text, target, flags and IREE version. Raises K3BackendError."""
    ic = _iree_compiler()
    if iree_target not in IREE_TARGETS:
        raise K3BackendError(f"unknown IREE target '{iree_target}' (want one of {', '.join(IREE_TARGETS)})")
    from .config import get_mlir_config
    backend, flags = IREE_TARGETS[iree_target]
    if backend == "llvm-cpu" and (get_mlir_config().data_tiling if data_tiling is None else data_tiling):
        flags = flags + DATA_TILING_FLAGS
    import hashlib
    from importlib.metadata import version
    key = hashlib.sha256("\0".join([text, backend, *flags, version("iree-base-compiler")]).encode()).hexdigest()
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
    """Runs entry functions as IREE functions on the ``local-task`` CPU driver (float32 compute). ``weights``,
    ``param_form`` and ``data_tiling`` (``MlirConfig``'s when built, kept for its lifetime): ``weights="bf16"``
    passes the parameters the IR declares bf16 as bf16 arrays (float values rounded to bf16 once, in
    ``prepare_params``); ``param_form="globals"`` binds the arrays ``prepare_params`` returns as the module's IREE
    parameters when a function group is loaded (a ``run`` with another such dict reloads the group with it),
    ``"arguments"`` passes them as device arrays on every call."""

    def __init__(self, module: Module, dtype: str = "float32", device: str = "cpu"):
        if dtype != "float32":
            raise K3BackendError(f"target 'mlir' runs float32, not '{dtype}'")
        if device != "cpu":
            raise K3BackendError(f"target 'mlir' runs on the CPU (IREE llvm-cpu), not '{device}'")
        super().__init__(module, "mlir", dtype, device)
        rt = _iree_runtime()
        from .config import get_mlir_config
        cfg = get_mlir_config()
        self.weights, self.param_form, self.data_tiling = cfg.weights, cfg.param_form, cfg.data_tiling
        #: the MLIR forms in effect when built (every ``MlirConfig`` field but ``cache``): a function group emitted
        #: later (on first use, outside the caller's ``mlir_config`` scope) is emitted under them
        self.forms = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "cache"}
        self.config = rt.Config("local-task")
        self.vmfb: dict[tuple[str, ...], bytes] = {}
        self.param_order: dict[str, list[str]] = {}
        self._modules: dict[str, Any] = {}
        #: group -> the params dict its loaded module is bound to (``param_form="globals"``)
        self._bound: dict[tuple[str, ...], Any] = {}
        #: functions compiled and loaded together (``GROUPS``, ``DATA_TILED_GROUPS``; a loaded artifact: its one module)
        self.groups: tuple[tuple[str, ...], ...] = DATA_TILED_GROUPS if self.data_tiling else GROUPS
        self._arrays: dict[str, np.ndarray] | None = None
        self._device_params: dict[str, Any] = {}
        self.weights_inside = False
        #: seconds emitting + IREE-compiling each function group took ("prefill+decode" -> s; a module found in
        #: the IREE cache takes well under a second)
        self.build_seconds: dict[str, float] = {}

    def _group(self, function: str) -> tuple[str, ...]:
        for g in self.groups:
            if function in g:
                return tuple(f for f in g if f in self.module.functions)
        return (function,)

    def compile_group(self, group: tuple[str, ...]) -> bytes:
        """The llvm-cpu ``.vmfb`` of ``group`` (emitted and compiled on first use; time in ``build_seconds``); data
        tiling (``self.data_tiling``) for groups without decode."""
        if group not in self.vmfb:
            from k3ir.progress import progress

            from .config import mlir_config
            with (mlir_config(**self.forms),
                  progress(f"mlir: emitting and compiling @{' @'.join(group)} with IREE (llvm-cpu)") as timing):
                text, order = emit_mlir(self.module, group, weights=self.weights, param_form=self.param_form)
                self.param_order.update(order)
                self.vmfb[group] = compile_mlir(text, "llvm-cpu", data_tiling=self.data_tiling and "decode" not in group)
            self.build_seconds["+".join(group)] = timing.seconds
        return self.vmfb[group]

    def build_all(self, functions: tuple[str, ...] | None = None) -> dict[str, float]:
        """Compile the groups holding ``functions`` (None: every entry function) now, otherwise on first use;
        returns ``build_seconds``."""
        for g in self.groups:
            group = tuple(f for f in g if f in self.module.functions)
            if group and (functions is None or set(group) & set(functions)):
                self.compile_group(group)
        return dict(self.build_seconds)

    def _load_group(self, group: tuple[str, ...], params: dict[str, Any] | None = None) -> None:
        """Load ``group``'s module; under ``param_form="globals"`` with ``params`` (name -> host array) as its IREE
        parameters (scope ``PARAM_SCOPE``; IREE runs the module's initializers then: the weights' layout packing)."""
        rt = _iree_runtime()
        vmfb = self.compile_group(group)
        ctx = rt.SystemContext(config=self.config)
        if self.param_form == "globals":
            names = {n for f in group for n in self.param_order.get(f, [])}
            missing = sorted(names - set(params or {}))
            if missing:
                raise K3BackendError(f"mlir executable: no weights for {', '.join(missing[:3])}"
                                     f"{' ...' if len(missing) > 3 else ''} (call prepare_params first)")
            index = rt.ParameterIndex()
            for n in sorted(names):
                index.add_buffer(n, params[n])
            ctx.add_vm_module(rt.create_io_parameters_module(ctx.instance, index.create_provider(scope=PARAM_SCOPE)))
            self._bound[group] = params
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
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
                out[k] = (_packed_bytes(a, packed[k]) if self.param_form == "globals"
                          else _i4_view(rt, self.config.device, a, packed[k]))
                continue
            if k in bf16:
                import ml_dtypes  # a dependency of iree-base-runtime
                a = a.astype(np.float32).astype(ml_dtypes.bfloat16)
                if self.param_form == "globals":      # the parameter's bytes (the index takes plain buffers)
                    a = a.view(np.uint16)
            elif a.dtype.kind == "f":
                a = a.astype(np.float32)
            a = np.ascontiguousarray(a)
            out[k] = a if self.param_form == "globals" else rt.asdevicearray(self.config.device, a)
        self._arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self._device_params = out
        return out

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        p = params or self._device_params
        group = self._group(function)
        if function not in self._modules or (self.param_form == "globals" and self._bound.get(group) is not p):
            self._load_group(group, p)
        fn = self._modules[function]
        spec = self.module.functions[function].args
        ins = []
        for a, s in zip(args, spec):
            if hasattr(a, "detach"):
                a = a.detach().cpu().numpy()
            a = np.asarray(a)
            want = np.int64 if getattr(s.type, "dtype", "f32") in ("i64", "i32") else np.float32
            ins.append(np.ascontiguousarray(a.astype(want, copy=False)))
        if self.param_form == "arguments":
            ins += [p[n] for n in self.param_order[function]]
        outs = fn(*ins)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        return [np.asarray(o.to_host() if hasattr(o, "to_host") else o) for o in outs]

    def to_numpy(self, x: Any):
        return np.asarray(x)

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Write ``k3.vmfb`` (all entry functions in one llvm-cpu module, compiled without data tiling, which decode
        steps do not compile with: ``DATA_TILED_GROUPS``), ``module.mlir``, ``weights.safetensors``,
        ``module.k3`` and ``manifest.json``. Returns the directory."""
        from safetensors.numpy import save_file

        from ..artifact import write_manifest
        from .config import mlir_config
        params = params if params is not None else self._arrays
        if params is None:
            raise K3BackendError("mlir executable: no weights to save (pass params or call prepare_params)")
        os.makedirs(directory, exist_ok=True)
        fns = tuple(f for f in ("forward", "prefill", "decode") if f in self.module.functions)
        with mlir_config(**self.forms):
            text, order = emit_mlir(self.module, fns, weights=self.weights, param_form=self.param_form)
        with open(os.path.join(directory, "module.mlir"), "w") as f:
            f.write(text)
        with open(os.path.join(directory, "k3.vmfb"), "wb") as f:
            f.write(compile_mlir(text, "llvm-cpu", data_tiling=False))   # one module: decode does not data-tile
        arrays = {}
        for k, a in params.items():
            a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
            arrays[k] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)
        save_file(arrays, os.path.join(directory, "weights.safetensors"))
        write_manifest(directory, self.module, "mlir", self.dtype,
                       {"vmfb": "k3.vmfb", "mlir": "module.mlir", "weights": "weights.safetensors"},
                       functions=list(fns), param_order=order, iree_target="llvm-cpu", weights=self.weights,
                       param_form=self.param_form,
                       logits_to_keep=self.forms["logits_to_keep"])   # compiled in: [B,1,V] prefill logits if 1
        return directory


def load_executable(directory: str, man: dict, module: Module) -> MlirExecutable:
    """Reopen an artifact written by ``MlirExecutable.save`` from its checked manifest ``man`` and IR ``module``
    (``artifact.read_manifest``): no MLIR emission, no compilation. The ``.vmfb`` holds native code
    (docs/artifacts.md)."""
    from safetensors.numpy import load_file

    from ..artifact import artifact_file
    exe = MlirExecutable(module, man["dtype"])
    exe.weights = man.get("weights", "f32")                # the argument types the module was compiled with
    exe.param_form = man.get("param_form", "arguments")    # artifacts written before param_form passed arguments
    exe.data_tiling = False                                # the artifact's one module is compiled without it
    with open(artifact_file(directory, man, "vmfb"), "rb") as f:
        vmfb = f.read()
    fns = tuple(man["functions"])
    exe.param_order = {k: list(v) for k, v in man["param_order"].items()}
    exe.groups = (fns,)                                    # one module holds every function, loaded on first use
    exe.vmfb[fns] = vmfb
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


def _packed_bytes(a: np.ndarray, shape: list[int]) -> np.ndarray:
    """Packed MXFP4 bytes ``a`` (``u8[..., K/2]``) checked against the i4 ``shape`` they hold, as a contiguous
    ``uint8`` array (an IREE parameter's bytes). Raises K3BackendError when the byte count does not fit."""
    a = np.ascontiguousarray(np.asarray(a).astype(np.uint8, copy=False))
    if a.size * 2 != int(np.prod(shape)):
        raise K3BackendError(f"packed MXFP4 weights of {a.size} bytes do not fit mxfp4{shape} (want {np.prod(shape) // 2})")
    return a


def _bf16_params(module: Module) -> set[str]:
    """Parameters the IR declares bf16 (bf16 arguments under ``MlirConfig.weights="bf16"``)."""
    return {n for n, d in module.params.items() if d.type.dtype == "bf16"}


def _build(module: Module, dtype: str = "float32", device: str = "cpu") -> MlirExecutable:
    return MlirExecutable(module, dtype, device)


def _table():
    from . import contract, conv, kda, moe  # noqa: F401  (their entries register into TABLE)
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
