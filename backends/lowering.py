"""Lowering tables: op name -> emitter, filled with a decorator. Every code-generating backend
(ONNX, MLIR, TVM, ...) keeps one; ops missing from it fall back to their decomposition, and
``k3ir check`` reads the table to say which ops are native."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LoweringTable(dict):
    """``TABLE = LoweringTable()``; ``@TABLE.lowers("k3.add", "k3.sub") def emit(...)``."""

    def lowers(self, *names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            for n in names:
                self[n] = fn
            return fn
        return deco
