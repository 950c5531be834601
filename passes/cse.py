"""cse: common-subexpression elimination. Ops are pure (states are values), so two ops with
the same name, operands and attributes compute the same results; the later one is dropped.
Parameter reads merge by name. One linear sweep per function."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module
from k3ir.printer import fmt_attrs

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter


@register_pass("cse")
@dataclass
class CSE(Pass):
    def run(self, module: Module) -> PassResult:
        removed = 0
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            seen: dict[tuple, object] = {}
            subst: dict[int, object] = {}
            for op in fn.ops:
                if not op.results:
                    continue
                operands = tuple(id(subst.get(id(v), v)) for v in op.operands)
                key = (op.name, operands, fmt_attrs(op.attrs) if op.attrs else "")
                prev = seen.get(key)
                if prev is None:
                    seen[key] = op
                    continue
                if [r.type for r in prev.results] != [r.type for r in op.results]:
                    continue
                for old, new in zip(op.results, prev.results):
                    rw.replace(old, new)
                    subst[id(old)] = new
                rw.erase(op)
                removed += 1
            rw.commit()
        return PassResult(rewrites=removed)
