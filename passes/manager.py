"""Pass manager: a pass is a small class with a name, options as fields and
``run(module) -> PassResult``. Pipelines run on a copy of the module."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from k3ir.errors import K3Error
from k3ir.ir import Module
from k3ir.verify import verify_module

log = logging.getLogger("k3ir.passes")

PASSES: dict[str, type["Pass"]] = {}


@dataclass
class PassResult:
    rewrites: int = 0

    @property
    def changed(self) -> bool:
        return self.rewrites > 0


class Pass:
    name = ""

    def run(self, module: Module) -> PassResult:
        raise NotImplementedError


def register_pass(name: str):
    def deco(cls):
        cls.name = name
        PASSES[name] = cls
        return cls
    return deco


def run_pipeline(module: Module, passes: list[str], verify_each: bool = False, **_: Any) -> Module:
    """Run ``passes`` (names) on ``module`` in place; returns it. Unknown names raise K3Error."""
    from . import dce  # noqa: F401
    for name in passes:
        if name not in PASSES:
            raise K3Error(f"unknown pass '{name}' (known: {', '.join(sorted(PASSES))})")
        res = PASSES[name]().run(module)
        log.info("pass %s: %d rewrites", name, res.rewrites)
        if verify_each:
            verify_module(module)
    return module
