"""fuse-moe-experts: the routed-expert chain ``fuse-moe-dispatch`` leaves, ``grouped_matmul`` gate and up of one
input -> ``situ_glu``/``swiglu`` -> ``grouped_matmul`` down -> ``moe_combine``, becomes one ``k3.moe_experts``
(k3ir/ops/moe.py): the Triton lowering runs it as two grouped-GEMM launches (gate/up with the GLU fused; down
with the combine weight as a row scale) and one combine launch.

When the combine's only use is a residual of a ``k3.decode_linear`` (the shared expert's down projection made by
``fuse-decode-linear``), the combine moves into that op's epilogue: ``k3.moe_experts`` gets ``combine=False``
(its result is the scaled expert rows) and the ``k3.decode_linear`` gets ``combine=True`` with the rows and
``inv_perm`` as its last operands and one residual fewer (the Triton gemv sums them in the same launch).

Each intermediate value must be read only by the next op of the chain and not returned; gate, up and down must
share the quantisation (``quant``) and the dispatch offsets. Where only the gate/up GLU matches (its down
projection is not followed by the combine, as across expert parallelism's all-to-all), that part alone becomes a
``k3.moe_experts`` with ``down=False`` (one grouped launch). Every function is rewritten (prefill and decode take
the same ops); each op equals its decomposition."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module, Operation

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter, producer

_ACTS = {"k3.situ_glu": "situ", "k3.swiglu": "silu"}


def _only_use(rw: Rewriter, v) -> Operation | None:
    us = rw.uses(v)
    return us[0] if len(us) == 1 and not rw.is_returned(v) else None


def _chain(rw: Rewriter, glu: Operation):
    """(gate, up, down, combine) of the chain through ``glu``, (gate, up, None, None) when only the GLU part
    matches, or None."""
    g, u = producer(glu.operands[0], "k3.grouped_matmul"), producer(glu.operands[1], "k3.grouped_matmul")
    if (g is None or u is None or g is u or g.operands[0] is not u.operands[0] or g.operands[1] is not u.operands[1]
            or _only_use(rw, g.results[0]) is not glu or _only_use(rw, u.results[0]) is not glu
            or g.attrs.get("quant", "none") != u.attrs.get("quant", "none")):
        return None
    d = _only_use(rw, glu.results[0])
    if (d is None or d.name != "k3.grouped_matmul" or d.operands[0] is not glu.results[0]
            or d.operands[1] is not g.operands[1] or d.attrs.get("quant", "none") != g.attrs.get("quant", "none")):
        return g, u, None, None
    c = _only_use(rw, d.results[0])
    if c is None or c.name != "k3.moe_combine" or c.operands[0] is not d.results[0]:
        return g, u, None, None
    return g, u, d, c


def _residual_reader(rw: Rewriter, v) -> Operation | None:
    """The ``k3.decode_linear`` that reads ``v`` once, as a residual and nowhere else, if that is its only use."""
    lin = _only_use(rw, v)
    if lin is None or lin.name != "k3.decode_linear" or lin.attrs.get("combine"):
        return None
    nres = int(lin.attrs.get("residuals", 0))
    if nres == 0 or sum(x is v for x in lin.operands) != 1:
        return None
    return lin if any(x is v for x in lin.operands[len(lin.operands) - nres:]) else None


@register_pass("fuse-moe-experts")
@dataclass
class FuseMoEExperts(Pass):
    def run(self, module: Module) -> PassResult:
        counts = {"chains": 0, "combine_in_linear": 0, "glu_only": 0}
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            found = [(op, ch) for op in fn.ops if op.name in _ACTS for ch in [_chain(rw, op)] if ch is not None]
            for glu, (g, u, d, c) in found:
                layer = glu.attrs.get("layer")
                prefix = f"l{layer}." if layer is not None else ""
                quant = g.attrs.get("quant", "none")
                attrs = {"act": _ACTS[glu.name], "quant": quant}
                if glu.name == "k3.situ_glu":
                    attrs.update(b1=float(glu.attrs.get("b1", 4.0)), b2=float(glu.attrs.get("b2", 25.0)))
                if d is None:                    # the gate/up GLU alone (its down is not followed by the combine)
                    b = rw.build_before(glu, prefix=prefix)
                    b.layer = layer
                    out = b.op("k3.moe_experts", g.operands[0], g.operands[1], *g.operands[2:], *u.operands[2:],
                               **attrs, down=False, combine=False, _name="moe_glu")
                    rw.replace(glu.results[0], out)
                    for o in (g, u, glu):
                        rw.erase(o)
                    counts["glu_only"] += 1
                    continue
                ws = [*g.operands[2:], *u.operands[2:], *d.operands[2:]]
                lin = _residual_reader(rw, c.results[0])
                attrs["combine"] = lin is None
                b = rw.build_before(c, prefix=prefix)
                b.layer = layer
                rows, offsets = g.operands[0], g.operands[1]
                comb_w, inv = c.operands[1], c.operands[2]
                tail = [comb_w] + ([inv] if lin is None else [])
                out = b.op("k3.moe_experts", rows, offsets, *ws, *tail, **attrs,
                           _name="moe_out" if lin is None else "moe_rows")
                if lin is None:
                    rw.replace(c.results[0], out)
                else:                            # the combine summed in the decode_linear's epilogue
                    v = c.results[0]
                    lb = rw.build_before(lin, prefix=prefix)
                    lb.layer = lin.attrs.get("layer")
                    new_attrs = dict(lin.attrs, residuals=int(lin.attrs["residuals"]) - 1, combine=True)
                    new = lb.op("k3.decode_linear", *[x for x in lin.operands if x is not v], out, inv, **new_attrs,
                                _name="lin_res")
                    rw.replace(lin.results[0], new)
                    rw.erase(lin)
                    counts["combine_in_linear"] += 1
                for o in (g, u, glu, d, c):
                    rw.erase(o)
                counts["chains"] += 1
            if found:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=counts["chains"] + counts["glu_only"], details=counts)
