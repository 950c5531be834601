"""fuse-decode-linear: linears with the prologue and epilogue of one weight-streaming GEMV as
``k3.decode_linear`` (k3ir/ops/nn.py), in the order the rules are tried:

1. ``glu``: ``swiglu(linear(x, Wg), linear(x, Wu))`` of one input (the shared expert, the dense MLP),
   each linear used once;
2. residual adds: ``linear(x, W)`` whose only use is ``add`` of a same-typed tensor (then at most one
   more such ``add`` of that sum): the sum ``((x W^T) + r1) + r2`` with the residuals in the epilogue;
3. ``splits``: the linears left over that read one input with parameter weights (MLA ``q_a`` /
   ``kv_a`` / gate, the dense gate and up, the latent-MoE down and shared gate/up): one op, one result
   per linear;
4. ``norm="rms"``: an ``rmsnorm`` whose every use is the input of one of the ops above moves into
   their prologue and goes away (a norm also read by a lone linear, a KDA layer or a router stays here:
   ``fuse-decode-norm`` and ``fuse-moe-front`` move it later).

A value returned by the function, or read twice, is never folded. Every function is rewritten (the
Triton lowering runs these ops as one GEMV launch when the rows fit, ``gemv.MAX_ROWS``, and as the
decomposition otherwise), so prefill and decode take the same ops; each op equals its decomposition.

``fuse-linear-splits`` is rule 3 alone, over every linear with a parameter weight (no GLU, residual or norm
folding): the linears that read one input become one ``k3.decode_linear`` with ``splits``, one result per
linear. The ONNX exporter lowers that op as one ``MatMul`` over the weights concatenated at export time and a
``Split`` (``backends/onnx/lowering.py``): fewer, wider prefill GEMMs (KDA's q/k/v/gate/beta projections, MLA's
q/kv down-projections, an MLP's gate/up).
"""
from __future__ import annotations

from dataclasses import dataclass

from k3ir.ir import Function, Module, Operation, Value

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter, producer


@dataclass
class _Group:
    """One ``k3.decode_linear`` to build: the ops it replaces, where it goes, and its operands."""
    kind: str                      # glu | add | cat | one (a lone linear, fused only with a norm)
    anchor: Operation              # the new op goes right before it
    linears: list[Operation]
    adds: list[Operation]          # the residual adds (kind add), in chain order
    residuals: list[Value]
    outs: list[Value]              # the values the new op's results replace
    erase: list[Operation]


def _only_use(rw: Rewriter, v: Value) -> Operation | None:
    us = rw.uses(v)
    return us[0] if len(us) == 1 and not rw.is_returned(v) else None


def _groups(fn: Function, rw: Rewriter, splits_only: bool = False) -> list[_Group]:
    taken: set[int] = set()
    groups: list[_Group] = []
    for op in fn.ops:                                                   # 1. SwiGLU of two linears
        if splits_only or op.name != "k3.swiglu":
            continue
        g, u = producer(op.operands[0], "k3.linear"), producer(op.operands[1], "k3.linear")
        if (g is None or u is None or g is u or g.operands[0] is not u.operands[0]
                or _only_use(rw, g.results[0]) is not op or _only_use(rw, u.results[0]) is not op):
            continue
        taken.update((id(g), id(u), id(op)))
        groups.append(_Group("glu", op, [g, u], [], [], [op.results[0]], [g, u, op]))
    for op in fn.ops:                                                   # 2. residual adds
        if splits_only or op.name != "k3.linear" or id(op) in taken:
            continue
        chain, cur = [], op
        while len(chain) < 2:
            a = _only_use(rw, cur.results[0])
            if a is None or a.name != "k3.add" or id(a) in taken or a.operands[0] is a.operands[1]:
                break
            r = a.operands[1] if a.operands[0] is cur.results[0] else a.operands[0]
            if r.type != op.results[0].type:                           # a broadcast add (a bias) stays
                break
            chain.append(a)
            cur = a
        if not chain:
            continue
        res, prev = [], op.results[0]
        for a in chain:
            res.append(a.operands[1] if a.operands[0] is prev else a.operands[0])
            prev = a.results[0]
        taken.update(id(o) for o in [op, *chain])
        groups.append(_Group("add", chain[-1], [op], chain, res, [chain[-1].results[0]], [op, *chain]))
    by_input: dict[int, list[Operation]] = {}                          # 3. linears of one input
    for op in fn.ops:
        if op.name == "k3.linear" and id(op) not in taken and producer(op.operands[1], "k3.param") is not None:
            by_input.setdefault(id(op.operands[0]), []).append(op)
    for ops in by_input.values():
        if len(ops) < 2:
            continue
        taken.update(id(o) for o in ops)
        groups.append(_Group("cat", ops[0], ops, [], [], [o.results[0] for o in ops], list(ops)))
    if splits_only:
        return groups
    for op in fn.ops:                                                   # lone linears (rule 4 sees them)
        if op.name == "k3.linear" and id(op) not in taken:
            groups.append(_Group("one", op, [op], [], [], [op.results[0]], [op]))
    return groups


@register_pass("fuse-decode-linear")
@dataclass
class FuseDecodeLinear(Pass):
    #: rule 3 only (``fuse-linear-splits``)
    _splits_only = False

    def run(self, module: Module) -> PassResult:
        counts = {"glu": 0, "add": 0, "cat": 0, "norm": 0}
        for fn in module.functions.values():
            rw = Rewriter(module, fn)
            groups = _groups(fn, rw, self._splits_only)
            if not groups:
                continue
            readers: dict[int, list[_Group]] = {}                     # rmsnorm result -> groups reading it as x
            for g in groups:
                readers.setdefault(id(g.linears[0].operands[0]), []).append(g)
            normed: dict[int, Operation] = {}                          # id(group) -> its absorbed rmsnorm
            for op in fn.ops:                                           # 4. norms read only as linear inputs
                if self._splits_only or op.name != "k3.rmsnorm" or rw.is_returned(op.results[0]):
                    continue
                r = op.results[0]
                gs = readers.get(id(r), [])
                lin_uses = sum(len(g.linears) for g in gs)
                if not gs or any(g.kind == "one" for g in gs) or lin_uses != len(rw.uses(r)) or any(
                        v is r for g in gs for lin in g.linears for v in lin.operands[1:]) or any(
                        v is r for g in gs for v in g.residuals):
                    continue
                for g in gs:
                    normed[id(g)] = op
                rw.erase(op)
                counts["norm"] += 1
            built = 0
            for g in groups:
                nrm = normed.get(id(g))
                if g.kind == "one":
                    continue                                            # a lone linear stays k3.linear
                lin0 = g.linears[0]
                x = lin0.operands[0] if nrm is None else nrm.operands[0]
                ws = [lin.operands[1] for lin in g.linears]
                attrs: dict = {}
                ops: list = [x, *ws]
                if nrm is not None:
                    attrs.update(norm="rms", eps=float(nrm.attrs.get("eps", 1e-6)))
                    ops.append(nrm.operands[1])
                if g.kind == "glu":
                    attrs["glu"] = True
                elif g.kind == "cat":
                    attrs["splits"] = len(ws)
                else:
                    attrs["residuals"] = len(g.residuals)
                    ops += g.residuals
                for lin in g.linears[1:]:                               # later weights' param reads move up
                    p = producer(lin.operands[1], "k3.param")
                    if p is not None and fn.ops.index(p) > fn.ops.index(g.anchor):
                        rw.erase(p)
                        rw.before.setdefault(id(g.anchor), []).append(p)
                layer = lin0.attrs.get("layer")
                b = rw.build_before(g.anchor, prefix=f"l{layer}." if layer is not None else "")
                b.layer = layer
                out = b.op("k3.decode_linear", *ops, **attrs, _name=[{"glu": "glu", "add": "lin_res"}.get(g.kind, "lin")] * len(g.outs))
                outs = out if isinstance(out, tuple) else (out,)
                for old, new in zip(g.outs, outs):
                    rw.replace(old, new)
                for o in g.erase:
                    rw.erase(o)
                counts[g.kind] += 1
                built += 1
            if built or counts["norm"]:
                rw.commit()
                rw.builder.prefix, rw.builder.layer = "", None
        total = counts["glu"] + counts["add"] + counts["cat"]
        return PassResult(rewrites=total + counts["norm"], details=counts)


@register_pass("fuse-linear-splits")
@dataclass
class FuseLinearSplits(FuseDecodeLinear):
    """Rule 3 of ``fuse-decode-linear`` alone: the linears with parameter weights that read one input as one
    ``k3.decode_linear`` with ``splits`` (the ONNX exporter's wider GEMMs; the module docstring)."""
    _splits_only = True
