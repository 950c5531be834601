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


def lower_or_decompose(emitter: Any, op: Any) -> tuple[Callable[..., Any] | None, Any]:
    """For a code-generating emitter with ``table``, ``module``, ``native``/``fallback`` counters
    and a ``_decomp`` cache: ``(impl, None)`` when the table lowers ``op`` natively, else
    ``(None, decomposition Function)`` (built once per op). Counts which path each op took
    (``k3ir check`` and the exporters' metadata report them)."""
    impl = emitter.table.get(op.name)
    if impl is not None:
        emitter.native[op.name] = emitter.native.get(op.name, 0) + 1
        return impl, None
    emitter.fallback[op.name] = emitter.fallback.get(op.name, 0) + 1
    fn = emitter._decomp.get(id(op))
    if fn is None:
        from .interpreter import decompose_op
        fn = emitter._decomp[id(op)] = decompose_op(emitter.module, op)
    return None, fn
