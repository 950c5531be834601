"""k3ir: a compiler for the Kimi K3 model family.

    import k3ir
    m = k3ir.load("k3-tiny")                      # bundled name, config.json or checkpoint dir
    exe = k3ir.compile(m, target="torch")
    from k3ir.runtime import Session
    logits = Session(exe).forward(ids)
"""
from __future__ import annotations

from typing import Any

from .errors import (K3BackendError, K3CheckpointError, K3ConfigError, K3Error, K3ParseError,
                     K3RuntimeError, K3VerifyError)
from .ir import Function, Module, Operation, ParamDecl, Value
from .parser import parse_file, parse_module
from .printer import print_module
from .types import StateType, TensorType
from .verify import verify_module

__version__ = "0.1.0"

__all__ = ["Function", "K3BackendError", "K3CheckpointError", "K3ConfigError", "K3Error", "K3ParseError",
           "K3RuntimeError", "K3VerifyError", "Module", "Operation", "ParamDecl", "StateType", "TensorType",
           "Value", "compile", "load", "parse_file", "parse_module", "print_module", "verify_module",
           "__version__"]


def load(name_or_path: str, overrides: dict[str, Any] | None = None) -> Module:
    """Build a Module from a bundled name (``kimi-k3``, ``k3-tiny``), a config.json path or a
    checkpoint directory. ``overrides`` sets config keys (dotted keys reach
    ``linear_attn_config``). Raises K3ConfigError naming the key."""
    from .frontend import load as _load
    return _load(name_or_path, overrides)


def compile(module: Module, target: str = "torch", dtype: str = "float32", device: str = "cpu", **options: Any):
    """Run ``target``'s pass pipeline on a copy of ``module`` and build an Executable.
    ``dtype``: ``float32`` | ``bfloat16`` | ``float64`` (compute dtype); raises K3BackendError."""
    from .backends import compile_module
    return compile_module(module, target=target, dtype=dtype, device=device, **options)
