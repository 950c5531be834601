"""Import of the built-in modules named by the registration lists (op families ``k3ir.ops.FAMILIES``,
passes ``k3ir.passes.manager.BUILTIN_PASSES``, targets ``k3ir.backends.BUILTIN``, CLI commands
``k3ir.cli.COMMAND_MODULES``): a module missing from the installation is a packaging error,
reported as such instead of a later "unknown pass/op/target"."""
from __future__ import annotations

import importlib
from types import ModuleType


def import_builtin(module: str, kind: str) -> ModuleType:
    """Import ``module`` (dotted name), one of the built-in ``kind`` modules (``"op family"``, ``"pass"``,
    ``"backend"``, ``"command"``). Raises ModuleNotFoundError naming the module and its kind when its file is
    absent; an import error inside the module propagates unchanged."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ModuleNotFoundError(f"k3ir is installed without its built-in {kind} module {module} "
                                  f"(a packaging error: reinstall k3ir)", name=module) from None
