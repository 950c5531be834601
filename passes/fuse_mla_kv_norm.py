"""fuse-mla-kv-norm: an absorbed ``k3.mla`` whose ``kv`` operand is ``concat(rmsnorm(latent), k_rope)`` (the
``kv_a_layernorm`` of the latent and the shared rope key, SPEC.md 4), each used only there, becomes one
``k3.mla_kv_norm`` (k3ir/ops/mla.py): the Triton decode kernel norms the latent and writes the cache row
in its prologue. Only absorbed MLA (decode functions after ``absorb-mla``) is rewritten."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter, producer


@register_pass("fuse-mla-kv-norm")
@dataclass
class FuseMLAKVNorm(Pass):
    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            found = []
            for op in fn.ops:
                if op.name != "k3.mla" or not op.attrs.get("absorbed"):
                    continue
                cat = producer(op.operands[1], "k3.concat")
                if (cat is None or len(cat.operands) != 2 or int(cat.attrs.get("axis", -1)) not in (-1, 2)
                        or rw.uses(cat.results[0]) != [op] or rw.is_returned(cat.results[0])):
                    continue
                nrm = producer(cat.operands[0], "k3.rmsnorm")
                if nrm is None or rw.uses(nrm.results[0]) != [cat] or rw.is_returned(nrm.results[0]):
                    continue
                found.append((op, cat, nrm))
            for op, cat, nrm in found:
                layer = op.attrs.get("layer")
                b = rw.build_before(op, prefix=f"l{layer}." if layer is not None else "")
                b.layer = None
                q, _, w, *rest = op.operands
                attrs = dict(op.attrs, eps=float(nrm.attrs.get("eps", 1e-6)))
                new = b.op("k3.mla_kv_norm", q, nrm.operands[0], cat.operands[1], nrm.operands[1], w, *rest,
                           **attrs, _name=["mla_o", "mla_cache"])
                for old, v in zip(op.results, new):
                    rw.replace(old, v)
                for o in (op, cat, nrm):
                    rw.erase(o)
                count += 1
            if found:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=count, details={"mla_layers": count})
