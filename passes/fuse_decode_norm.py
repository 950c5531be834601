"""fuse-decode-norm: an ``rmsnorm`` whose every reader can norm the raw row itself moves into those readers and
goes away (the Triton kernels apply it in their prologue: the weight-streaming GEMV, the KDA decode projections).
Readers, each reading the norm's result as its input row only:

- ``k3.linear``: becomes a ``k3.decode_linear`` with ``norm="rms"`` (one weight);
- ``k3.decode_linear`` with no prologue (``norm="none"``): gets ``norm="rms"`` and the norm weight;
- ``k3.fused_kda`` / ``k3.fused_kda_ungated`` without an input norm: gets ``norm="rms"`` and the norm weight as
  its last operand (k3ir/ops/kda.py).

A norm with any other reader, or returned, stays. Run last in the ``decode`` phase (after ``fuse-decode-linear``,
``fuse-kda-output``, ``fuse-moe-front``: norms they fold are gone). Every function is rewritten (a prologue norm
runs as the decomposition's standalone norm where the rows do not fit the kernels); each op equals its
decomposition."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Module, Operation

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter

_KDA = ("k3.fused_kda", "k3.fused_kda_ungated")


def _base(name: str, default: str) -> str:
    """A result name without its layer prefix and counter (``l3.kda_o.2`` -> ``kda_o``), else ``default``."""
    parts = [p for p in name.split(".") if not p.isdigit() and not (p[:1] == "l" and p[1:].isdigit())]
    return parts[0] if parts else default


def _reader_ok(c: Operation, r) -> bool:
    if c.operands[0] is not r or any(v is r for v in c.operands[1:]):
        return False
    if c.name == "k3.linear":
        return True
    if c.name == "k3.decode_linear":
        return c.attrs.get("norm", "none") == "none"
    return c.name in _KDA and c.attrs.get("norm", "none") == "none"


@register_pass("fuse-decode-norm")
@dataclass
class FuseDecodeNorm(Pass):
    def run(self, module: Module) -> PassResult:
        counts = {"norms": 0, "linear": 0, "decode_linear": 0, "kda": 0}
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            found = []
            for op in fn.ops:
                if op.name != "k3.rmsnorm" or rw.is_returned(op.results[0]):
                    continue
                readers = rw.uses(op.results[0])
                if readers and all(_reader_ok(c, op.results[0]) for c in readers):
                    found.append((op, readers))
            for nrm, readers in found:
                x, nw = nrm.operands
                eps = float(nrm.attrs.get("eps", 1e-6))
                for c in readers:
                    layer = c.attrs.get("layer")
                    b = rw.build_before(c, prefix=f"l{layer}." if layer is not None else "")
                    b.layer = None
                    if c.name == "k3.linear":
                        new = b.op("k3.decode_linear", x, c.operands[1], nw, **dict(c.attrs, norm="rms", eps=eps),
                                   _name="lin")
                        outs = (new,)
                        counts["linear"] += 1
                    elif c.name == "k3.decode_linear":
                        nws = 2 if c.attrs.get("glu") else int(c.attrs.get("splits", 1))
                        ops = [x, *c.operands[1:1 + nws], nw, *c.operands[1 + nws:]]
                        new = b.op("k3.decode_linear", *ops, **dict(c.attrs, norm="rms", eps=eps),
                                   _name=[_base(r.name, "lin") for r in c.results])
                        outs = new if isinstance(new, tuple) else (new,)
                        counts["decode_linear"] += 1
                    else:
                        new = b.op(c.name, x, *c.operands[1:], nw, **dict(c.attrs, norm="rms", norm_eps=eps),
                                   _name=[_base(r.name, "kda") for r in c.results])
                        outs = new
                        counts["kda"] += 1
                    for old, v in zip(c.results, outs):
                        rw.replace(old, v)
                    rw.erase(c)
                rw.erase(nrm)
                counts["norms"] += 1
            if found:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=counts["norms"], details=counts)
