"""Lowering tables: op name -> implementation, filled with a decorator, plus the conditions under
which an entry applies. Every backend keeps one (reference, torch, triton, tvm, onnx, mlir and
plugins; ``Backend.table``); ops missing from it, and ops whose condition refuses them, fall back to
their decomposition, and ``k3ir check`` reads the same table and conditions to say how each op runs.

    TABLE = LoweringTable()

    @TABLE.lowers("k3.grouped_matmul", when=lambda op: None if op.attrs["quant"] != "int4" else "int4 packing")
    def emit(...): ...

A condition ``when(op) -> None | reason`` sees the IR ``Operation`` (its attributes and operand
types: dtype, quantisation, static shapes); None = the entry lowers it, a string = why not (the op
then runs its decomposition, and ``k3ir check`` shows it as *conditional* with that reason).
A condition that only the run-time values can decide (row counts, autograd) is the implementation's: it
returns ``NotImplemented`` and the interpreter runs the decomposition; ``fallbacks`` (op name -> when)
records it for ``k3ir check``, which shows it beside the native entry.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3ir.builder import Builder
from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module, Operation
from k3ir.opdef import get_opdef

#: ``when(op) -> None | reason``
Condition = Callable[[Any], "str | None"]


class LoweringTable(dict):
    """``dict`` op name -> implementation, with per-op conditions (``conditions``: op name ->
    ``when(op) -> None | reason``). A plain dict works wherever a table is expected (no conditions)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.conditions: dict[str, Condition] = {}
        #: op name -> when its implementation declines at run time (returns NotImplemented: the decomposition runs)
        self.fallbacks: dict[str, str] = {}

    def falls_back(self, *names: str, when: str) -> None:
        """Record that the entries ``names`` run their decomposition at run time ``when`` (KeyError for a missing one)."""
        for n in names:
            if n not in self:
                raise KeyError(n)
            self.fallbacks[n] = when

    def lowers(self, *names: str, when: Condition | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering the implementation for ``names``; ``when`` (optional) restricts it."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            for n in names:
                self[n] = fn
                if when is not None:
                    self.conditions[n] = when
                else:
                    self.conditions.pop(n, None)
            return fn
        return deco

    def condition(self, *names: str, when: Condition) -> None:
        """Attach ``when`` to entries ``names`` already in the table (KeyError for a missing one)."""
        for n in names:
            if n not in self:
                raise KeyError(n)
            self.conditions[n] = when

    def supports(self, op: Any) -> str | None:
        """None when this table lowers ``op`` natively; else the reason it does not (not in the
        table, or its condition's reason)."""
        if op.name not in self:
            return f"no lowering for {op.name}"
        cond = self.conditions.get(op.name)
        return None if cond is None else cond(op)

    def copy(self) -> LoweringTable:
        out = LoweringTable(self)
        out.conditions = dict(self.conditions)
        out.fallbacks = dict(self.fallbacks)
        return out


def table_supports(table: Any, op: Any) -> str | None:
    """None when ``table`` (a LoweringTable or a plain mapping) lowers ``op`` natively, else why not."""
    if isinstance(table, LoweringTable):
        return table.supports(op)
    return None if op.name in table else f"no lowering for {op.name}"


def table_fallback(table: Any, name: str) -> str | None:
    """When ``table``'s entry for op ``name`` runs the op's decomposition at run time (None: never said)."""
    return getattr(table, "fallbacks", {}).get(name)


def native_impl(table: Any, op: Any) -> Callable[..., Any] | None:
    """``table``'s implementation of ``op`` when it lowers it natively (its condition holds), else None."""
    impl = table.get(op.name)
    if impl is None or (isinstance(table, LoweringTable) and table.supports(op) is not None):
        return None
    return impl


def decompose_op(module: Module | None, op: Operation) -> Function:
    """A Function whose arguments are ``op``'s operands and whose body is its decomposition."""
    cls = get_opdef(op.name)
    if cls.decompose is None:
        raise K3BackendError(f"op '{op.name}' has no lowering on this backend and no decomposition")
    fn = Function(f"__decomp_{op.name[3:]}")
    b = Builder(module, fn)
    args = [b.arg(f"a{i}", v.type) for i, v in enumerate(op.operands)]
    inst = cls(op.attrs, [v.type for v in op.operands])
    grouped = cls.group_operands(args)
    out = inst.decompose(b, *cls.ordered(grouped))
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    return fn


def lower_or_decompose(emitter: Any, op: Any) -> tuple[Callable[..., Any] | None, Any]:
    """For a code-generating emitter with ``table``, ``module``, ``native``/``fallback`` counters
    and a ``_decomp`` cache: ``(impl, None)`` when the table lowers ``op`` natively (its condition,
    if any, holds), else ``(None, decomposition Function)`` (built once per op). Counts which path
    each op took (``k3ir check`` and the exporters' metadata report them)."""
    impl = native_impl(emitter.table, op)
    if impl is not None:
        emitter.native[op.name] = emitter.native.get(op.name, 0) + 1
        return impl, None
    emitter.fallback[op.name] = emitter.fallback.get(op.name, 0) + 1
    fn = emitter._decomp.get(id(op))
    if fn is None:
        fn = emitter._decomp[id(op)] = decompose_op(emitter.module, op)
    return None, fn
