"""Frontends: HF-style config.json (kimi_k3, kimi_linear) -> k3ir Module."""
from .config import BUNDLED, ModelConfig, apply_overrides, build_config, load_config, parse_override_value
from .model import build_module

__all__ = [
    "BUNDLED",
    "ModelConfig",
    "apply_overrides",
    "build_config",
    "build_module",
    "load",
    "load_config",
    "parse_override_value",
]


def load(name_or_path: str, overrides=None, strict: bool = True):
    """Build the Module for a bundled name, a config.json path or a checkpoint directory. A
    directory binds its safetensors weights lazily (``module.weights``, see
    :func:`checkpoint.bind_checkpoint`; ``strict``: unused checkpoint tensors are an error); a
    directory without ``*.safetensors`` files raises K3CheckpointError naming it (random weights
    come only from an explicit bundled name or ``config.json`` path)."""
    import os
    module = build_module(load_config(name_or_path, overrides))
    if isinstance(name_or_path, (str, os.PathLike)) and os.path.isdir(name_or_path):
        from .checkpoint import bind_checkpoint
        bind_checkpoint(module, os.fspath(name_or_path), strict=strict)
    return module
