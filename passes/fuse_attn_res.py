"""fuse-attn-res: keep the AttnRes block snapshots (SPEC.md 2) in one stacked buffer
``[B,T,S,d]`` and turn each mix into one ``k3.attn_res_fused`` reading the first ``n`` slots
plus the running partial sum. Each snapshot is written once (``k3.attn_res_store``, slot i)
right before the first mix that reads it. A function whose mixes do not read the snapshots as
one growing prefix is left unchanged (and logged)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter

log = logging.getLogger("k3ir.passes")


@register_pass("fuse-attn-res")
@dataclass
class FuseAttnRes(Pass):
    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            mixes = [op for op in fn.ops if op.name == "k3.attn_res" and len(op.operands) > 3]
            if not mixes:
                continue
            order: list = []
            slot: dict[int, int] = {}
            ok = True
            for op in mixes:
                blocks = op.operands[2:-1]
                for i, v in enumerate(blocks):
                    if id(v) not in slot:
                        if i != len(order):
                            ok = False
                            break
                        slot[id(v)] = len(order)
                        order.append(v)
                    elif slot[id(v)] != i:
                        ok = False
                        break
                if not ok:
                    break
            if not ok:
                log.info("fuse-attn-res: @%s snapshots are not one growing prefix; left unfused", fn.name)
                continue
            S = len(order)
            rw = Rewriter(module, fn)
            bufs: list = []
            for op in mixes:
                n = len(op.operands) - 3
                layer = op.attrs.get("layer")
                b = rw.build_before(op, prefix=f"l{layer}." if layer is not None else "")
                b.layer = None
                while len(bufs) < n:
                    i = len(bufs)
                    prev = bufs[-1] if bufs else None
                    bufs.append(b.op("k3.attn_res_store", order[i], prev, slot=i, slots=S, _name="res_blocks"))
                attrs = {"n_blocks": n, "eps": float(op.attrs.get("eps", 1e-6))}
                if layer is not None:
                    attrs["layer"] = layer
                out = b.op("k3.attn_res_fused", op.operands[0], op.operands[1], bufs[n - 1], op.operands[-1],
                           _name="res_mix", **attrs)
                rw.replace(op.results[0], out)
                rw.erase(op)
                count += 1
            rw.commit()
            rw.builder.prefix = ""
        return PassResult(rewrites=count, details={"mixes": count})
