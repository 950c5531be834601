"""The mlir target's switches: ``MlirConfig``. A field with an environment variable takes its default from it, read
once at the first ``get_mlir_config()`` (never at import); ``with mlir_config(cache=path): ...`` overrides it for a
block (nested scopes, restored on exit, this thread / asyncio task only)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import ScopedConfig, setting


@dataclass(frozen=True)
class MlirConfig:
    """Switches of the mlir target (``backends/mlir``)."""
    cache: str | None = setting(None, "directory of compiled IREE modules (``<cache>/iree/<key>.vmfb``, keyed by the "
                                "MLIR text, IREE target, flags and IREE version); None: ``~/.cache/k3ir``",
                                env="K3IR_CACHE")

    def cache_dir(self) -> str:
        """``cache``, or ``~/.cache/k3ir`` when it is None."""
        return self.cache or os.path.join(os.path.expanduser("~"), ".cache", "k3ir")


MLIR = ScopedConfig(MlirConfig, "k3ir_mlir_config")


def get_mlir_config() -> MlirConfig:
    """The MlirConfig in effect here (innermost ``mlir_config`` scope, else the environment defaults, read once)."""
    return MLIR.get()


def mlir_config(**changes: Any):
    """Context manager: ``get_mlir_config()`` returns the current config with ``changes`` inside the block; nests;
    restores on exit. Raises K3ConfigError on an unknown field."""
    return MLIR.override(**changes)
