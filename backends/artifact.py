"""Compiled-artifact directories (``k3ir compile MODEL --target T -o DIR``): ``module.k3`` (the
compiled IR), the target's files, and ``manifest.json`` naming the loader (``"module:function"``)
that ``Session.load(DIR)`` calls to reopen the executable without recompiling."""
from __future__ import annotations

import json
import os
from typing import Any

from k3ir.errors import K3RuntimeError
from k3ir.ir import Module

ARTIFACT = "k3ir-artifact"


def write_manifest(directory: str, module: Module, target: str, dtype: str, loader: str,
                   files: dict[str, str], **extra: Any) -> None:
    """Write ``module.k3`` and ``manifest.json`` into ``directory``."""
    from k3ir.printer import print_module
    with open(os.path.join(directory, "module.k3"), "w") as f:
        f.write(print_module(module))
    man = {"format": ARTIFACT, "target": target, "dtype": dtype, "loader": loader, "files": files,
           "module": "module.k3", **extra}
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(man, f, indent=2)


def read_manifest(directory: str, target: str) -> tuple[dict, Module]:
    """(manifest, compiled module) of an artifact of ``target``; K3RuntimeError otherwise."""
    from k3ir.parser import parse_file
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise K3RuntimeError(f"{directory}: not a compiled artifact (no manifest.json)")
    with open(path) as f:
        man = json.load(f)
    if man.get("format") != ARTIFACT or man.get("target") != target:
        raise K3RuntimeError(f"{path}: expected a '{target}' artifact, found target '{man.get('target')}'")
    return man, parse_file(os.path.join(directory, man.get("module", "module.k3")))
