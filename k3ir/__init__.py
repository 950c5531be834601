"""k3ir: a compiler for the Kimi K3 model family.

    import k3ir
    m = k3ir.load("k3-tiny")                      # bundled name, config.json or checkpoint dir
    exe = k3ir.compile(m, target="torch")
    from k3ir.runtime import Session
    logits = Session(exe).forward(ids)
"""
from __future__ import annotations

from typing import Any

from .errors import (
    K3BackendError,
    K3CheckpointError,
    K3ConfigError,
    K3Error,
    K3ParseError,
    K3RuntimeError,
    K3VerifyError,
)
from .ir import Function, Module, Operation, ParamDecl, Value
from .parser import parse_file, parse_module
from .printer import print_module
from .types import StateType, TensorType
from .verify import verify_module

__version__ = "0.1.0"

__all__ = [
    "Function",
    "K3BackendError",
    "K3CheckpointError",
    "K3ConfigError",
    "K3Error",
    "K3ParseError",
    "K3RuntimeError",
    "K3VerifyError",
    "Module",
    "Operation",
    "ParamDecl",
    "StateType",
    "TensorType",
    "Value",
    "__version__",
    "compile",
    "load",
    "parse_file",
    "parse_module",
    "print_module",
    "save",
    "verify_module",
]


def load(name_or_path: str, overrides: dict[str, Any] | None = None, strict: bool = True) -> Module:
    """Build a Module from a bundled name (``kimi-k3``, ``k3-tiny``), a config.json path or a
    checkpoint directory; a ``.k3`` IR file (``k3ir print``) is parsed and verified, as
    ``k3ir.parse_file`` + ``k3ir.verify_module`` (K3ParseError / K3VerifyError with file:line:col).
    ``overrides`` sets config keys (dotted keys reach ``linear_attn_config``). Raises K3ConfigError naming the key. A directory with safetensors
    weights binds them lazily as ``module.weights`` (name -> array); missing, extra (unless
    ``strict=False``), mis-shaped or wrongly typed tensors raise K3CheckpointError."""
    import os

    from .errors import K3ConfigError
    from .frontend import load as _load
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise K3ConfigError(f"load: name_or_path must be a model name or a path (str), got "
                            f"{type(name_or_path).__name__} {name_or_path!r}"[:300])
    if overrides is not None and not isinstance(overrides, dict):
        raise K3ConfigError(f"load: overrides must be a dict of config keys (e.g. {{'hidden_size': 96}}), got "
                            f"{type(overrides).__name__}")
    path = os.fspath(name_or_path)
    if path.endswith(".k3") and os.path.isfile(path):        # what `k3ir print` writes: parse + verify it
        if overrides:
            raise K3ConfigError(f"{path}: overrides set config keys; a .k3 IR file has no config (edit the "
                                "file, or load the model's config.json with overrides)")
        module = parse_file(path)
        verify_module(module)
        return module
    return _load(path, overrides, strict=strict)


def save(module: Module, params: Any, directory: str, layout: str = "published", quantize: str | None = None,
         **options: Any) -> list[str]:
    """Write ``params`` (name -> array, IR names; stacked experts ``[E, ...]``; None: the weights
    bound to ``module``) and ``config.json`` to ``directory`` as safetensors. ``layout``:
    ``published`` | ``transformers`` | ``hf-runtime``; ``quantize``: None | ``mxfp4`` | ``int4``
    (routed experts only, compressed-tensors packing, SPEC.md 7). ``options``: ``dtype``
    (``float32`` | ``bfloat16`` | ``float16`` | ``float64``, or ``f32``/``bf16``/``f16``/``f64``:
    the stored dtype of unquantised float tensors; default None keeps each tensor's own dtype, as
    ``save_pretrained`` does: float32 params are stored F32 even when the config says bf16, and
    weights bound from a checkpoint keep their stored dtype; a narrower explicit dtype rounds and
    logs a warning),
    ``max_shard_bytes``, ``shared_experts`` (``fused`` | ``split``). Returns the file names
    written; raises K3CheckpointError (also for an unknown ``dtype``, naming the allowed values,
    and for a directory that cannot be created or written, naming the path and the OS reason)."""
    import os

    from .frontend.checkpoint import save_checkpoint
    if params is None:
        if module.weights is None:
            raise K3CheckpointError("save: no params given and the module has no bound weights")
        params = module.weights
    try:
        return save_checkpoint(module, params, directory, layout=layout, quantize=quantize, **options)
    except OSError as e:                  # unwritable / missing parent / a file in the way / disk full
        why = e.strerror or str(e)
        if not os.path.isdir(directory):
            raise K3CheckpointError(f"{directory}: cannot create the directory ({why})") from e
        raise K3CheckpointError(f"{e.filename or directory}: cannot write the checkpoint ({why})") from e


def compile(module: Module, target: str = "torch", dtype: str | None = None, device: str = "cpu", **options: Any):
    """Run ``target``'s pass pipeline on a copy of ``module`` and build an Executable.
    ``dtype``: ``float32`` | ``bfloat16`` | ``float16`` | ``float64`` (compute dtype), as far as the
    target supports it (``Backend.dtypes``: onnx float32/float16, mlir float32, tvm float32/float64,
    reference float64 only; a ``torch.dtype`` such as ``torch.float32`` names the same); None (default)
    = the target's default (float32; float64 for ``reference``). Raises K3BackendError naming the dtype and the supported ones."""
    from .backends import compile_module
    from .errors import K3BackendError
    if not isinstance(module, Module):
        if isinstance(module, str):
            raise K3BackendError(f"compile takes a Module: use k3ir.load({module!r}) first")
        raise K3BackendError(f"compile takes a Module (from k3ir.load or k3ir.parse_file), got "
                             f"{type(module).__name__}")
    if dtype is not None and type(dtype).__module__ == "torch" and str(dtype).startswith("torch."):
        dtype = str(dtype)[len("torch."):]             # torch.float32 -> "float32" (checked by the target as usual)
    return compile_module(module, target=target, dtype=dtype, device=device, **options)
