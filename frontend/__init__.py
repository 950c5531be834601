"""Frontends: HF-style config.json (kimi_k3, kimi_linear) -> k3ir Module."""
from .config import BUNDLED, ModelConfig, apply_overrides, build_config, load_config, parse_override_value
from .model import build_module

__all__ = ["BUNDLED", "ModelConfig", "apply_overrides", "build_config", "build_module", "load_config",
           "parse_override_value", "load"]


def load(name_or_path: str, overrides=None):
    """Build the Module for a bundled name, a config.json path or a checkpoint directory."""
    return build_module(load_config(name_or_path, overrides))
