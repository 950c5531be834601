"""Dead-code elimination: drop ops none of whose results is used or returned."""
from __future__ import annotations

from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass


@register_pass("dce")
class DCE(Pass):
    """Remove ops whose results are all unused (ops are pure; states are values)."""

    def run(self, module: Module) -> PassResult:
        removed = 0
        for fn in module.functions.values():
            live = {id(v) for v in fn.returns}
            keep = []
            for op in reversed(fn.ops):
                if any(id(r) in live for r in op.results):
                    keep.append(op)
                    live.update(id(v) for v in op.operands)
                else:
                    removed += 1
            fn.ops = list(reversed(keep))
        return PassResult(rewrites=removed)
