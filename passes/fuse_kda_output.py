"""fuse-kda-output: a decode KDA layer's gated head norm (SPEC.md 3.6) moves into the linears that read
its output. For each ``k3.fused_kda`` with ``mode="recurrent"`` whose output is not returned and is read
only as the input ``x`` of ``k3.decode_linear``s without a prologue (``o_proj``, made by
``fuse-decode-linear``), the layer becomes ``k3.fused_kda_ungated`` (o before the norm, plus the gate
input ``gz``) and each reader gets ``norm="gated"`` with the layer's ``o_norm`` weight, ``gz`` and eps:
the Triton gemv applies the norm in its prologue. Run after ``fuse-decode-linear``; every function."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter

#: operand index of ``o_norm`` in ``k3.fused_kda`` (x, then ops/kda.py KDA_WEIGHTS)
_O_NORM = 12


@register_pass("fuse-kda-output")
@dataclass
class FuseKDAOutput(Pass):
    def run(self, module: Module) -> PassResult:
        count = 0
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            todo = []
            for op in fn.ops:
                if op.name != "k3.fused_kda" or op.attrs.get("mode") != "recurrent":
                    continue
                o = op.results[0]
                readers = rw.uses(o)
                if rw.is_returned(o) or not readers or not all(
                        c.name == "k3.decode_linear" and c.attrs.get("norm", "none") == "none"
                        and c.operands[0] is o and all(v is not o for v in c.operands[1:]) for c in readers):
                    continue
                todo.append((op, readers))
            for op, readers in todo:
                layer = op.attrs.get("layer")
                b = rw.build_before(op, prefix=f"l{layer}." if layer is not None else "")
                b.layer = None
                new = b.op("k3.fused_kda_ungated", *op.operands, **op.attrs,
                           _name=["kda_o", "conv_q_state", "conv_k_state", "conv_v_state", "kda_state", "kda_gate"])
                for old, v in zip(op.results[1:], new[1:5]):
                    rw.replace(old, v)
                rw.erase(op)
                o, gz = new[0], new[5]
                for c in readers:
                    nw = 2 if c.attrs.get("glu") else int(c.attrs.get("splits", 1))
                    ws, res = c.operands[1:1 + nw], c.operands[1 + nw:]
                    attrs = dict(c.attrs, norm="gated", eps=float(op.attrs.get("eps", 1e-6)))
                    cb = rw.build_before(c, prefix=f"l{layer}." if layer is not None else "")
                    cb.layer = None
                    out = cb.op("k3.decode_linear", o, *ws, op.operands[_O_NORM], gz, *res, **attrs,
                                _name=["lin_res" if res else "lin"] * len(c.results))
                    for r_old, r_new in zip(c.results, out if isinstance(out, tuple) else (out,)):
                        rw.replace(r_old, r_new)
                    rw.erase(c)
                count += 1
            if todo:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=count, details={"kda_layers": count})
