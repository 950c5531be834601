"""Linear-time rewriting of one Function: collect erasures, insertions and value
substitutions, then apply them in a single sweep (``commit``). New ops are built with a
Builder (types inferred and verified) into a scratch list and placed before an anchor op."""
from __future__ import annotations

from k3ir.builder import Builder
from k3ir.ir import Function, Module, Operation, Value


class Rewriter:
    """Batch edits to ``fn``: ``erase(op)``, ``build_before(anchor)`` (a Builder whose ops go
    right before ``anchor``), ``replace(old, new)`` (all uses, returns included)."""

    def __init__(self, module: Module | None, fn: Function):
        self.module, self.fn = module, fn
        self._users: dict[int, list[Operation]] | None = None
        self.erased: set[int] = set()
        self.before: dict[int, list[Operation]] = {}
        self.subst: dict[int, Value] = {}
        self.builder = Builder(module, fn)
        self._returned = {id(v) for v in fn.returns}

    @property
    def users(self) -> dict[int, list[Operation]]:
        if self._users is None:
            self._users = self.fn.users()
        return self._users

    def is_returned(self, v: Value) -> bool:
        return id(v) in self._returned

    def uses(self, v: Value) -> list[Operation]:
        return self.users.get(id(v), [])

    def erase(self, op: Operation) -> None:
        self.erased.add(id(op))

    def build_before(self, anchor: Operation, prefix: str | None = None) -> Builder:
        """The shared Builder, redirected to append to the list inserted before ``anchor``."""
        scratch = Function("__scratch")
        scratch.ops = self.before.setdefault(id(anchor), [])
        self.builder.function = scratch
        self.builder.insert_at = None
        if prefix is not None:
            self.builder.prefix = prefix
        return self.builder

    def replace(self, old: Value, new: Value) -> None:
        self.subst[id(old)] = new

    def _resolve(self, v: Value) -> Value:
        seen = 0
        while id(v) in self.subst and seen < 1000:
            v = self.subst[id(v)]
            seen += 1
        return v

    def commit(self) -> None:
        ops: list[Operation] = []
        for op in self.fn.ops:
            ops.extend(self.before.get(id(op), ()))
            if id(op) not in self.erased:
                ops.append(op)
        if self.subst:
            for op in ops:
                if any(id(v) in self.subst for v in op.operands):
                    op.operands = [self._resolve(v) for v in op.operands]
            self.fn.returns = [self._resolve(v) for v in self.fn.returns]
        self.fn.ops = ops
        self.builder.function = self.fn
        self.before, self.erased, self.subst, self._users = {}, set(), {}, None


def producer(v: Value | None, name: str | None = None) -> Operation | None:
    """The op producing ``v`` (None for arguments), optionally only if it is op ``name``."""
    if v is None or v.producer is None:
        return None
    if name is not None and v.producer.name != name:
        return None
    return v.producer
