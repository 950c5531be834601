"""absorb-mla: in decode functions (T == 1) compute MLA in the absorbed form (SPEC.md 4):
``q~ = W_uk^T q_nope`` scores directly against the cached 576-wide ``[c_kv | k_rope]`` latent,
and ``W_uv`` is applied after the attention-weighted latent sum. The cache already holds only
the latent and the rope key; the result equals the unabsorbed one."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass


@register_pass("absorb-mla")
@dataclass
class AbsorbMLA(Pass):
    """Set ``absorbed=True`` on every ``k3.mla`` whose query has T == 1 (decode), or in every
    function when ``all_functions``."""
    all_functions: bool = False

    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            for op in fn.ops:
                if op.name != "k3.mla" or op.attrs.get("absorbed"):
                    continue
                if self.all_functions or op.operands[0].type.shape[1] == 1:
                    op.attrs["absorbed"] = True
                    count += 1
        return PassResult(rewrites=count, details={"absorbed": count})
