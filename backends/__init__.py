"""Backends: a registry of targets. A backend has a name, a target description (what its code relies
on), a pass pipeline in named phases and a lowering table (op name -> implementation, with per-op
conditions: ``lowering.LoweringTable``); ops missing from the table, or refused by its ``supports``
hook, fall back to their decomposition. Out-of-tree backends register through the entry-point group
``k3ir.backends``."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3BackendError
from k3ir.ir import Module, Operation
from k3ir.registration import import_builtin

from .artifact_write import save_ir_artifact

_BACKENDS: dict[str, Backend] = {}
_ALIASES: dict[str, str] = {}
_LOADED = False
#: built-in backend packages (folders under backends/); each registers on import and must import
#: its heavy dependency (triton, tvm, onnxruntime, iree) lazily, reporting absence via ``available``; every
#: package under backends/ is listed (tests/test_layering.py checks it)
BUILTIN = ("reference", "torch", "triton", "tvm", "onnx", "mlir")


@dataclass(frozen=True)
class TargetDescription:
    """What a backend's generated code relies on, for ``k3ir check`` and ``k3ir backends`` (not a switch:
    switches live in the backend's config). ``kind``: the device or format family (``cuda``, ``llvm``,
    ``onnx``, ...); ``toolchain``: what compiles or runs the code; ``arch``: the oldest architecture it targets
    (e.g. ``sm_90``); ``features``: device features the kernels use, each ``name: what for``; ``limits``:
    ``(name, value)`` pairs the kernels are sized for (bytes, counts; the unit in the name)."""
    kind: str
    toolchain: str = ""
    arch: str = ""
    features: tuple[str, ...] = ()
    limits: tuple[tuple[str, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "toolchain": self.toolchain, "arch": self.arch, "features": list(self.features),
                "limits": dict(self.limits)}

    def summary(self) -> str:
        """One line: ``kind arch, toolchain; relies on: features; limits``."""
        head = " ".join(x for x in (self.kind, self.arch) if x)
        parts = [head + (f" ({self.toolchain})" if self.toolchain else "")]
        if self.features:
            parts.append("relies on: " + ", ".join(f.split(":")[0] for f in self.features))
        if self.limits:
            parts.append(", ".join(f"{k}={v:,}" for k, v in self.limits))
        return "; ".join(parts)


@dataclass
class Backend:
    """A target: ``build(module, dtype, device) -> Executable`` plus its pass pipeline and its
    lowering table.

    ``phases``: the pipeline as named phases, ``[(phase, [pass specs])]`` (``passes.pipelines``; e.g.
    ``[("fuse", ["fuse-kda-chunks"]), ("cleanup", ["dce"])]``); a backend may list passes of its own
    (registered with ``k3ir.passes.register_pass``). ``pipeline``: the same passes as one flat list; give
    either (a flat ``pipeline`` alone is grouped into the phases of ``passes.pipelines.PHASES``, unknown
    passes into a phase ``passes``). ``target_description``: what the generated code relies on
    (:class:`TargetDescription`), None when nothing beyond the host.

    ``table``: ``() -> Mapping`` op name -> implementation (called lazily: a table may import the
    backend's heavy dependency); a ``lowering.LoweringTable`` carries per-op conditions. ``support``:
    optional ``(op: Operation) -> None | reason`` for conditional support (dtype, quantisation, static
    shapes); default: the table's own conditions. ``function_support``: optional ``(module, function
    name) -> None | reason`` for functions the backend cannot lower as a whole (e.g. argument shapes
    it cannot express). ``lowers``: ``() -> set`` of op names, the older form of ``table`` (plugins
    may pass either; given ``table``, ``lowers`` defaults to its keys). ``functions``: the entry
    functions ``build`` compiles (None = every function)."""
    name: str
    description: str
    build: Callable[..., Executable]
    pipeline: list[str] = field(default_factory=list)
    lowers: Callable[[], set[str]] | None = None
    aliases: tuple[str, ...] = ()
    available: Callable[[], str | None] = field(default=lambda: None)   # None = usable here, else why not
    functions: tuple[str, ...] | None = None     # entry functions build() compiles; None = every function
    #: compute dtypes build() accepts (canonical names, see DTYPES); None = all of them
    dtypes: tuple[str, ...] | None = None
    #: ``(directory, manifest, module) -> Executable`` reopening what ``Executable.save`` wrote (``Session.load``);
    #: None = the IR artifact of ``Executable.save`` (``artifact.load_ir_artifact``). See docs/artifacts.md.
    load_artifact: Callable[[str, dict, Module], Executable] | None = None
    table: Callable[[], Mapping[str, Any]] | None = None
    support: Callable[[Operation], str | None] | None = None
    function_support: Callable[[Module, str], str | None] | None = None
    phases: list[tuple[str, list[str]]] | None = None
    target_description: TargetDescription | None = None
    #: the executable ``build`` returns writes the generated device source into its artifact when its
    #: ``emit_source`` is set (``k3ir compile --emit-source``): the tvm-<kind> GPU targets
    emits_source: bool = False

    def __post_init__(self) -> None:
        from k3ir.passes.pipelines import check_phases, flatten, group_phases
        if self.phases is None:
            self.pipeline = list(self.pipeline)
            self.phases = group_phases(self.pipeline)
        else:
            self.phases = check_phases(self.phases, f"backend '{self.name}'")
            if self.pipeline and list(self.pipeline) != flatten(self.phases):
                raise K3BackendError(f"backend '{self.name}': pipeline {self.pipeline} and phases "
                                     f"{flatten(self.phases)} differ (give one of them)")
            self.pipeline = flatten(self.phases)
        if self.lowers is None:
            table = self.table
            self.lowers = (lambda: set(table())) if table is not None else (lambda: set())

    def lowering_table(self) -> Mapping[str, Any]:
        """op name -> implementation (``table()``; for a backend declaring only ``lowers()``, its names
        mapped to None)."""
        if self.table is not None:
            return self.table()
        return dict.fromkeys(self.lowers())

    def supports(self, op: Operation) -> str | None:
        """None when this backend lowers ``op`` natively, else why not: not in its table, or the reason
        its ``support`` hook (default: the table's conditions) gives for this op's attributes/types."""
        from .lowering import table_supports
        if op.name not in self.lowers():
            return f"no lowering for {op.name}"
        if self.support is not None:
            return self.support(op)
        return table_supports(self.lowering_table(), op) if self.table is not None else None

    def runtime_fallback(self, op: Operation) -> str | None:
        """When this backend's native lowering of ``op`` runs the op's decomposition instead, decided at run time
        (the table's ``fallbacks``; e.g. triton's ``k3.decode_linear`` above ``gemv.MAX_ROWS`` rows), else None."""
        from .lowering import table_fallback
        return table_fallback(self.lowering_table(), op.name) if self.table is not None else None

    def function_problem(self, module: Module, function: str) -> str | None:
        """None when this backend builds ``function`` of ``module`` (as far as can be told before
        compiling), else why not: not one of ``functions``, or the ``function_support`` hook's reason."""
        if self.functions is not None and function not in self.functions:
            return f"target '{self.name}' builds only {', '.join(self.functions)}"
        if self.function_support is not None:
            return self.function_support(module, function)
        return None


def register_backend(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    for a in backend.aliases:
        _ALIASES[a] = backend.name
    return backend


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for name in BUILTIN:                 # built-in targets register themselves on import
        import_builtin(f"{__name__}.{name}", "backend")
    load_plugins()


def load_plugins() -> list[str]:
    """Register the backends of the entry-point group ``k3ir.backends`` (each entry point is a
    Backend or a callable returning one); returns the names registered. Called once on first
    use of the registry; call again after installing a plugin into a running process."""
    import logging
    from importlib.metadata import entry_points
    names = []
    for ep in entry_points(group="k3ir.backends"):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, Backend):
                obj = obj()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not break the other targets
            logging.getLogger("k3ir").warning("backend plugin '%s' failed to load: %s", ep.name, e)
            continue
        if isinstance(obj, Backend):
            register_backend(obj)
            names.append(obj.name)
        else:
            logging.getLogger("k3ir").warning("backend plugin '%s' is not a k3ir.backends.Backend", ep.name)
    return names


def get_backend(target: str) -> Backend:
    """The Backend registered as ``target`` (or an alias). Raises K3BackendError."""
    _load()
    name = _ALIASES.get(target, target)
    if name not in _BACKENDS:
        import difflib
        near = difflib.get_close_matches(str(target).lower(), sorted(set(_BACKENDS) | set(_ALIASES)), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        if str(target).lower().split(":")[0] in ("cpu", "cuda", "gpu"):
            hint = f"; '{target}' is a device, not a target: use target torch or triton with device '{target}'"
        raise K3BackendError(f"unknown target '{target}' (registered: {', '.join(sorted(_BACKENDS))}){hint}")
    return _BACKENDS[name]


def list_backends() -> list[Backend]:
    _load()
    return [_BACKENDS[k] for k in sorted(_BACKENDS)]


class Executable:
    """A compiled module for one target. ``run(function, args, params)`` executes an entry
    function; ``params`` maps parameter names to backend arrays (see ``prepare_params``)."""

    def __init__(self, module: Module, target: str, dtype: str, device: str):
        self.module = module
        self.target = target
        self.dtype = dtype
        self.device = device

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def to_numpy(self, x: Any):
        raise NotImplementedError

    def save(self, directory: str, params: dict[str, Any]) -> str:
        """Write a loadable artifact (``Session.load(directory)``). Targets that compile to code
        (onnx, mlir, tvm) override this; the default stores the compiled IR and the weights."""
        return save_ir_artifact(self, directory, params)

    def __repr__(self) -> str:
        return f"<Executable {self.module.name} target={self.target} dtype={self.dtype} device={self.device}>"


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "f32": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float64": "float64", "f64": "float64", "float16": "float16",
                "fp16": "float16", "f16": "float16"}
#: canonical compute dtypes, most common first
DTYPES = ("float32", "bfloat16", "float16", "float64")


def resolve_dtype(backend: Backend, dtype: str | None) -> str:
    """The canonical compute dtype for ``dtype`` (``float32`` | ``bfloat16`` | ``float16`` |
    ``float64``, or ``fp32``/``f32``/``bf16``/``fp16``/``f16``/``f64``) on ``backend``; None = the
    target's default (the first of ``Backend.dtypes``, else float32: float64 for ``reference``).
    Raises K3BackendError naming ``dtype`` and the dtypes ``backend`` supports (``Backend.dtypes``)
    for an unknown dtype or one the target does not compute in; called before anything is built."""
    ok = backend.dtypes or DTYPES
    if dtype is None:
        return ok[0]
    canon = _DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else None
    if canon is None or canon not in ok:
        what = "unknown dtype" if canon is None else "unsupported dtype"
        hint = ""
        if backend.name == "reference" and canon is not None:     # the oracle never changes precision silently
            hint = f"; the reference target is the float64 NumPy oracle: use target 'torch' to compute in {canon}"
        raise K3BackendError(f"{what} '{dtype}' for target '{backend.name}' (supported: {', '.join(ok)}){hint}")
    return canon


def device_problem(device: str, need_gpu: bool = True) -> str | None:
    """Why ``device`` cannot be used, or None: k3ir runs on ``cpu`` and ``cuda[:N]``; ``need_gpu``: also
    check that the CUDA device exists here."""
    try:
        import torch
    except ImportError:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        return f"unknown device '{device}' (want cpu, cuda or cuda:N)"
    if d.type not in ("cpu", "cuda"):
        return f"device '{device}' is not supported (k3ir runs on cpu, cuda or cuda:N)"
    if d.type == "cuda" and need_gpu:
        if not torch.cuda.is_available():
            return f"device '{device}' requested but no CUDA GPU is available"
        if d.index is not None and d.index >= torch.cuda.device_count():
            return f"device '{device}' does not exist (this machine has {torch.cuda.device_count()} CUDA GPU(s))"
    return None


def _check_device(device: str) -> None:
    """K3BackendError for a device string k3ir cannot use (``tpu``, ``mps``, ``cuda:x``, ``cuda:7`` on a
    one-GPU machine, ``cuda`` without a GPU)."""
    why = device_problem(device)
    if why:
        raise K3BackendError(why)


def compile_module(module: Module, target: str = "torch", dtype: str | None = None, device: str = "cpu",
                   passes: list[str] | None = None, verify_each: bool = False, **options: Any) -> Executable:
    """Verify ``module`` (K3VerifyError with ``file:line:col`` for a parsed module: an invalid module
    never compiles), check ``dtype`` against the target's dtypes (:func:`resolve_dtype`; None = the
    target's default: float32, float64 for ``reference``), run the
    target's pipeline (or ``passes``) on a copy of it, then build. ``mesh`` (option, torch and triton): the
    DeviceMesh a sharded module runs on (docs/distributed.md). Raises K3BackendError."""
    from k3ir.verify import verify_module
    verify_module(module)
    backend = get_backend(target)
    dtype = resolve_dtype(backend, dtype)        # before availability: a bad dtype is an error on any machine
    why = backend.available()
    if why:
        raise K3BackendError(f"target '{target}' cannot run here: {why}")
    _check_device(device)
    unknown = sorted(set(options) - {"quantize", "dump_dir", "results", "mesh"})
    if unknown:
        raise K3BackendError(f"compile: unknown option(s) {', '.join(unknown)} (known: target, dtype, device, "
                             "passes, verify_each, quantize, dump_dir, results, mesh)")
    mesh = options.pop("mesh", None)          # the DeviceMesh a sharded module runs on (docs/distributed.md)
    if mesh is not None:
        import inspect
        if "mesh" not in inspect.signature(backend.build).parameters:
            raise K3BackendError(f"target '{backend.name}' does not run sharded modules on a mesh (use torch or triton)")
    from k3ir.passes import run_pipeline
    m = run_pipeline(module.clone(), backend.phases if passes is None else passes, verify_each=verify_each, **options)
    return backend.build(m, dtype=dtype, device=device, **({"mesh": mesh} if mesh is not None else {}))
