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
    directory holding safetensors weights binds them lazily (``module.weights``, see
    :func:`checkpoint.bind_checkpoint`; ``strict``: unused checkpoint tensors are an error)."""
    import os
    module = build_module(load_config(name_or_path, overrides))
    if isinstance(name_or_path, (str, os.PathLike)) and os.path.isdir(name_or_path):
        from .checkpoint import bind_checkpoint, is_checkpoint_dir, note_no_weights
        if is_checkpoint_dir(name_or_path):
            bind_checkpoint(module, os.fspath(name_or_path), strict=strict)
        else:                             # config.json only: warn, random init (module.attrs note)
            note_no_weights(module, os.fspath(name_or_path))
    return module
