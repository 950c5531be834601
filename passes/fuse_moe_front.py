"""fuse-moe-front: a MoE layer's ``k3.router`` and ``k3.moe_dispatch`` of one input become one ``k3.moe_front``
(k3ir/ops/moe.py), run by the Triton lowering as the decode front kernels (``moe/dispatch.py``: router partial
logits, then top-k + the sorted row copy in one launch). Run after ``fuse-decode-linear`` and
``fuse-moe-experts``. A router qualifies when its weights and indices are read only by a dispatch of the
router's own input. Then, in order:

1. ``norm="rms"``: the input is an ``rmsnorm`` read only by that router, that dispatch and at most one
   shared-expert SwiGLU (a ``k3.decode_linear`` with ``glu``, no prologue, residual or combine, parameter
   weights): the norm moves into the front (the kernels norm the raw rows as they read them) and goes away;
2. ``shared_glu``: with the norm moved, that SwiGLU's gate/up weights join the front (``router_glu_kernel``
   computes them in the router's launch) and its result becomes the front's last;
3. ``routed_glu``: with both, when the router scores are unread and the dispatch results are read only by
   one unquantised ``k3.moe_experts`` with ``glu`` (and its combine operand of a ``k3.decode_linear``), that
   op's gate/up weights join the front, whose rows result is then the GLU rows (at most
   ``moe_decode.MAX_ROWS`` tokens the routed experts' GLU launch routes the step itself), and the
   ``k3.moe_experts`` becomes ``glu=False``.

Parameter reads the front needs that come after the router move up before it. Every function is rewritten;
each op equals its decomposition."""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Function, Module, Operation
from k3ir.opdef import instantiate

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter, producer


def _shared_glu(rw: Rewriter, v, router: Operation, dispatch: Operation) -> Operation | None | bool:
    """The one shared-expert SwiGLU reading ``v`` besides ``router`` and ``dispatch`` (None if none), or False
    when ``v`` has any other reader."""
    shared = None
    for c in rw.uses(v):
        if c is router or c is dispatch:
            continue
        a = c.attrs
        if (shared is None and c.name == "k3.decode_linear" and a.get("glu") and a.get("norm", "none") == "none"
                and not a.get("residuals", 0) and not a.get("combine") and c.operands[0] is v
                and len(c.operands) == 3 and all(producer(w, "k3.param") is not None for w in c.operands[1:])):
            shared = c
            continue
        return False
    return shared


def _routed_experts(rw: Rewriter, router: Operation, dispatch: Operation) -> Operation | None:
    """The unquantised ``k3.moe_experts`` (glu) that alone reads the dispatch results (besides the combine operand
    of a ``k3.decode_linear``), under a router whose scores nothing reads."""
    if rw.uses(router.results[2]) or rw.is_returned(router.results[2]):
        return None
    xs, off, inv, cw = dispatch.results
    e = [c for c in rw.uses(xs)]
    if len(e) != 1 or e[0].name != "k3.moe_experts":
        return None
    e = e[0]
    if (not e.attrs.get("glu") or not e.attrs.get("down", True) or e.attrs.get("quant", "none") != "none"
            or e.operands[0] is not xs
            or e.operands[1] is not off or any(rw.is_returned(v) for v in dispatch.results)
            or producer(e.operands[2], "k3.param") is None or producer(e.operands[3], "k3.param") is None):
        return None
    rows = e.results[0]
    for v in (off, cw, inv):
        for c in rw.uses(v):
            if c is e:
                continue
            if not (c.name == "k3.decode_linear" and c.attrs.get("combine") and v is inv
                    and c.operands[-1] is inv and c.operands[-2] is rows):
                return None
    return e


def _hoist(rw: Rewriter, fn: Function, values, anchor: Operation) -> bool:
    """Move the ``k3.param`` reads of ``values`` that come after ``anchor`` to right before it; False (nothing
    moved) when one of them is produced after ``anchor`` by anything else."""
    at = {id(o): i for i, o in enumerate(fn.ops)}
    late = []
    for v in values:
        p = v.producer
        if p is None or at[id(p)] < at[id(anchor)]:
            continue
        if p.name != "k3.param":
            return False
        late.append(p)
    for p in dict.fromkeys(late):
        rw.erase(p)
        rw.before.setdefault(id(anchor), []).append(p)
    return True


@register_pass("fuse-moe-front")
@dataclass
class FuseMoEFront(Pass):
    def run(self, module: Module) -> PassResult:
        counts = {"fronts": 0, "norm": 0, "shared_glu": 0, "routed_glu": 0}
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            built = 0
            for d in fn.ops:
                if d.name != "k3.moe_dispatch":
                    continue
                r = producer(d.operands[1], "k3.router")
                if (r is None or d.operands[2] is not r.results[1] or d.operands[0] is not r.operands[0]
                        or any(rw.uses(v) != [d] or rw.is_returned(v) for v in r.results[:2])):
                    continue
                x = r.operands[0]
                nrm = producer(x, "k3.rmsnorm")
                shared = _shared_glu(rw, x, r, d) if nrm is not None and not rw.is_returned(x) else False
                attrs = {**instantiate(r).router_attrs(), **instantiate(d).dispatch_attrs()}
                args: list = []
                if shared is not False:                          # 1. the norm into the front
                    attrs.update(norm="rms", norm_eps=float(nrm.attrs.get("eps", 1e-6)))
                    args.append(nrm.operands[1])
                    x = nrm.operands[0]
                e = None
                if shared:                                       # 2. the shared expert's SwiGLU gate/up
                    attrs["shared_glu"] = True
                    args += shared.operands[1:3]
                    e = _routed_experts(rw, r, d)
                    if e is not None:                            # 3. the routed experts' GLU
                        attrs.update(routed_glu=True, act=e.attrs.get("act", "situ"),
                                     b1=float(e.attrs.get("b1", 4.0)), b2=float(e.attrs.get("b2", 25.0)))
                        args += e.operands[2:4]
                if not _hoist(rw, fn, [r.operands[1], r.operands[2], *args], r):
                    continue
                layer = r.attrs.get("layer")
                prefix = f"l{layer}." if layer is not None else ""
                b = rw.build_before(r, prefix=prefix)
                b.layer = layer
                names = ["router_w", "router_idx", "router_scores", "moe_glu" if e is not None else "moe_x_sorted",
                         "moe_offsets", "moe_inv_perm", "moe_comb_w", "shared_glu"]
                out = b.op("k3.moe_front", x, r.operands[1], r.operands[2], *args, **attrs, _name=names)
                for old, new in zip([*r.results, *d.results], out):
                    rw.replace(old, new)
                if shared:
                    rw.replace(shared.results[0], out[7])
                    rw.erase(shared)
                    counts["shared_glu"] += 1
                if e is not None:
                    eb = rw.build_before(e, prefix=prefix)
                    eb.layer = e.attrs.get("layer")
                    ea = dict(e.attrs, glu=False)
                    new = eb.op("k3.moe_experts", out[3], out[4], *e.operands[4:], **ea,
                                _name="moe_out" if e.attrs.get("combine", True) else "moe_rows")
                    rw.replace(e.results[0], new)
                    rw.erase(e)
                    counts["routed_glu"] += 1
                if shared is not False:
                    rw.erase(nrm)
                    counts["norm"] += 1
                rw.erase(r)
                rw.erase(d)
                counts["fronts"] += 1
                built += 1
            if built:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        return PassResult(rewrites=counts["fronts"], details=counts)
