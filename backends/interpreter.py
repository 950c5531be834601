"""A graph interpreter shared by the eager backends: walks a Function, calls the backend's
lowering for each op, and falls back to the op's decomposition (into core ops) when the table
has no entry or the entry's condition refuses the op (``lowering.LoweringTable``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from k3ir.errors import K3BackendError
from k3ir.ir import Function, Module, Operation
from k3ir.opdef import get_opdef

from .lowering import decompose_op, native_impl

Impl = Callable[..., Any]


class Interpreter:
    """Runs functions of ``module`` with ``table`` (op name -> ``impl(inst, *operands)``; a
    ``LoweringTable``'s conditions are honoured: a refused op runs its decomposition, as ``k3ir check`` says;
    an implementation that returns ``NotImplemented`` for the values it was given, e.g. sizes its kernel
    does not take, also runs the op's decomposition).
    ``get_param(name)`` returns a parameter's runtime value; ``post(op, results)`` may convert
    results (e.g. dtype casts); ``observe(op, results)``, if given, sees every top-level op's
    final results (the trainer captures router scores with it)."""

    def __init__(self, module: Module, table: dict[str, Impl], get_param: Callable[[str], Any],
                 post: Callable[[Operation, list], list] | None = None,
                 observe: Callable[[Operation, list], None] | None = None):
        self.module = module
        self.table = table
        self.get_param = get_param
        self.post = post
        self.observe = observe
        self._decomp: dict[int, Function] = {}
        self._inst: dict[int, Any] = {}
        self._impl: dict[int, Impl | None] = {}

    def run(self, fn: str | Function, args: list[Any]) -> list[Any]:
        f = self.module.functions[fn] if isinstance(fn, str) else fn
        if len(args) != len(f.args):
            raise K3BackendError(f"@{f.name} takes {len(f.args)} arguments, got {len(args)}")
        env: dict[int, Any] = {id(a): x for a, x in zip(f.args, args)}
        top = f is self.module.functions.get(f.name)
        for op in f.ops:
            self.exec_op(op, env, observe=top)
        return [env[id(v)] for v in f.returns]

    def exec_op(self, op: Operation, env: dict[int, Any], observe: bool = True) -> None:
        """Evaluate ``op`` reading operands from ``env`` (``id(Value) -> value``) and store its
        results there (used by ``run`` and by callers that run op ranges themselves, e.g.
        activation checkpointing in the trainer)."""
        if op.name == "k3.param":
            env[id(op.results[0])] = self.get_param(op.attrs["name"])
            return
        out = self.eval_op(op, [env[id(v)] for v in op.operands])
        if self.post is not None:
            out = self.post(op, out)
        if observe and self.observe is not None:
            self.observe(op, out)
        for r, x in zip(op.results, out):
            env[id(r)] = x

    def eval_op(self, op: Operation, vals: list[Any]) -> list[Any]:
        key = id(op)
        if key in self._impl:
            impl = self._impl[key]
        else:
            impl = self._impl[key] = native_impl(self.table, op)
        if impl is None:
            if key not in self._decomp:
                self._decomp[key] = decompose_op(self.module, op)
            return self.run(self._decomp[key], vals)
        inst = self._inst.get(key)
        if inst is None:
            cls = get_opdef(op.name)
            inst = cls(op.attrs, [v.type for v in op.operands])
            object.__setattr__(inst, "call", self.run)
            self._inst[key] = inst
        cls = type(inst)
        grouped = cls.group_operands(vals)
        args = []
        for (name, spec) in cls._operands:
            g = grouped[name]
            if spec.variadic:
                args.extend(g)
            else:
                args.append(g)
        while args and args[-1] is None:
            args.pop()
        out = impl(inst, *args)
        if out is NotImplemented:       # the lowering declined these run-time values (sizes): the decomposition
            if key not in self._decomp:
                self._decomp[key] = decompose_op(self.module, op)
            return self.run(self._decomp[key], vals)
        return list(out) if isinstance(out, tuple) else [out]
