"""fuse-kda-chunks: fold each KDA layer (prelude, recurrence, epilogue) into one k3.fused_kda.

Matched per ``k3.kda`` (SPEC.md 3): the q/k/v projections, short conv + SiLU and reshape, the L2
norm of q and k, the decay gate ``kda_gate(W_fb W_fa x)``, ``beta = sigmoid(W_b x)``, the
recurrence, the output gate (``g_proj`` or ``g_b_proj g_a_proj``), the head RMSNorm and the
final reshape to ``[B,T,H*D]``. ``o_proj`` stays a ``k3.linear`` after the fused op. Decode
functions (T == 1) get ``mode="recurrent"``; others ``mode="chunk"``. A layer whose
intermediates are used outside the pattern is left unfused (and logged).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from k3ir.errors import K3Error
from k3ir.ir import Module, Operation, Value

from .manager import Pass, PassResult, register_pass
from .rewrite import Rewriter, producer

log = logging.getLogger("k3ir.passes")


@dataclass
class KDAMatch:
    kda: Operation
    x: Value
    ops: list[Operation]
    weights: list[Value]          # KDA_WEIGHTS order
    gate_w: list[Value]
    states: list[Value]           # conv q, k, v, recurrent (or empty)
    conv_ops: list[Operation]     # short_conv q, k, v (their state results)
    out: Value                    # the final reshape result ([B,T,H*D])
    attrs: dict


def _linear_of(v: Value, x: Value | None = None) -> Operation | None:
    op = producer(v, "k3.linear")
    if op is None or (x is not None and op.operands[0] is not x):
        return None
    return op


def _only_user(rw: Rewriter, v: Value) -> Operation | None:
    users = rw.uses(v)
    if len(users) != 1 or rw.is_returned(v):
        return None
    return users[0]


def _reshape_heads(v: Value, H: int, D: int) -> Operation | None:
    op = producer(v, "k3.reshape")
    if op is None or list(op.attrs.get("shape", [])) != [0, 0, H, D]:
        return None
    return op


def match_kda_layer(rw: Rewriter, kda: Operation) -> KDAMatch | None:
    """The KDA layer around ``kda``, or None when the structure differs from SPEC.md 3."""
    q, k, v, g, beta = kda.operands[:5]
    s_in = kda.operands[5] if len(kda.operands) > 5 else None
    H, D = int(k.type.shape[2]), int(k.type.shape[3])
    ops: list[Operation] = [kda]
    proj, convs, conv_w, lin_w, states = {}, [], [], [], []
    x = None
    for name, val in (("q", q), ("k", k), ("v", v)):
        if name in "qk":
            l2 = producer(val, "k3.l2norm")
            if l2 is None:
                return None
            ops.append(l2)
            val = l2.operands[0]
            proj[name + "_eps"] = l2.attrs.get("eps", 1e-6)
        rs = _reshape_heads(val, H, D)
        conv = producer(rs.operands[0], "k3.short_conv") if rs else None
        if conv is None or conv.attrs.get("activation", "silu") != "silu":
            return None
        lin = _linear_of(conv.operands[0], x)
        if lin is None:
            return None
        x = lin.operands[0]
        ops += [rs, conv, lin]
        convs.append(conv)
        conv_w.append(conv.operands[1])
        lin_w.append(lin.operands[1])
        states.append(conv.operands[2] if len(conv.operands) > 2 else None)
    if proj["q_eps"] != proj["k_eps"]:
        return None
    gate = producer(g, "k3.kda_gate")
    rz = _reshape_heads(gate.operands[0], H, D) if gate else None
    fb = _linear_of(rz.operands[0]) if rz else None
    fa = _linear_of(fb.operands[0], x) if fb else None
    if fa is None:
        return None
    ops += [gate, rz, fb, fa]
    sig = producer(beta, "k3.sigmoid")
    if sig is None:
        return None
    ops.append(sig)
    bl = sig.operands[0]
    cast = producer(bl, "k3.cast")
    if cast is not None:
        ops.append(cast)
        bl = cast.operands[0]
    lb = _linear_of(bl, x)
    if lb is None:
        return None
    ops.append(lb)
    # epilogue
    gn = _only_user(rw, kda.results[0])
    if gn is None or gn.name != "k3.gated_rmsnorm" or gn.operands[0] is not kda.results[0]:
        return None
    rg = _reshape_heads(gn.operands[1], H, D)
    if rg is None:
        return None
    gl = _linear_of(rg.operands[0])
    if gl is None:
        return None
    if gl.operands[0] is x:
        gate_w, full_rank = [gl.operands[1]], True
        ops += [gn, rg, gl]
    else:
        ga = _linear_of(gl.operands[0], x)
        if ga is None:
            return None
        gate_w, full_rank = [ga.operands[1], gl.operands[1]], False
        ops += [gn, rg, gl, ga]
    final = _only_user(rw, gn.results[0])
    if final is None or final.name != "k3.reshape" or list(final.attrs.get("shape", [])) != [0, 0, H * D]:
        return None
    ops.append(final)
    if any(s is None for s in states) and not all(s is None for s in states):
        return None
    if (s_in is None) != (states[0] is None):
        return None
    all_states = [] if s_in is None else states + [s_in]
    # every intermediate must stay inside the pattern (state results and the output excepted)
    inside = {id(o) for o in ops}
    kept = {id(final.results[0]), id(kda.results[1])} | {id(c.results[1]) for c in convs}
    for o in ops:
        for r in o.results:
            if id(r) in kept:
                continue
            if rw.is_returned(r) or any(id(u) not in inside for u in rw.uses(r)):
                return None
    weights = lin_w + conv_w + [fa.operands[1], fb.operands[1], gate.operands[1], gate.operands[2],
                                lb.operands[1], gn.operands[2]]
    T = x.type.shape[1]
    attrs = {"heads": H, "head_dim": D, "scale": float(kda.attrs["scale"]),
             "gate": gate.attrs["form"], "lower_bound": float(gate.attrs.get("lower_bound", -5.0)),
             "full_rank_gate": full_rank, "eps": float(gn.attrs.get("eps", 1e-6)),
             "qk_eps": float(proj["q_eps"]), "chunk_size": int(kda.attrs.get("chunk_size", 64)),
             "mode": "recurrent" if T == 1 else "chunk"}
    if "layer" in kda.attrs:
        attrs["layer"] = kda.attrs["layer"]
    return KDAMatch(kda, x, ops, weights, gate_w, all_states, convs, final.results[0], attrs)


@register_pass("fuse-kda-chunks")
@dataclass
class FuseKDAChunks(Pass):
    """Fold each KDA layer into one ``k3.fused_kda`` (chunked; recurrent in decode).
    Options: ``chunk_size`` (a positive multiple of 16; the default 0 keeps each layer's own), ``mode``
    (``auto``: recurrent iff T == 1, ``chunk`` or ``recurrent``). Raises K3Error naming a bad option."""
    chunk_size: int = 0
    mode: str = "auto"

    def __post_init__(self) -> None:
        self.check_options({})

    def check_options(self, given: dict) -> None:
        where = "pass 'fuse-kda-chunks' option"
        if ("chunk_size" in given or self.chunk_size) and (self.chunk_size <= 0 or self.chunk_size % 16):
            raise K3Error(f"{where} 'chunk_size': must be a positive multiple of 16 (the fused KDA tile), "
                          f"got {self.chunk_size}; omit it to keep each layer's own")
        if self.mode not in ("auto", "chunk", "recurrent"):
            raise K3Error(f"{where} 'mode': must be auto, chunk or recurrent, got {self.mode!r}")

    def run(self, module: Module) -> PassResult:
        count, skipped, modes = 0, 0, {"chunk": 0, "recurrent": 0}
        for fn in module.functions.values():
            kdas = [op for op in fn.ops if op.name == "k3.kda"]
            if not kdas:
                continue
            rw = Rewriter(module, fn)
            for kda in kdas:
                m = match_kda_layer(rw, kda)
                if m is None:
                    skipped += 1
                    log.info("fuse-kda-chunks: @%s layer %s does not match the KDA pattern; left unfused",
                             fn.name, kda.attrs.get("layer"))
                    continue
                attrs = dict(m.attrs)
                if self.chunk_size:
                    attrs["chunk_size"] = self.chunk_size
                if self.mode != "auto":
                    attrs["mode"] = self.mode
                layer = attrs.get("layer")
                b = rw.build_before(m.ops[-1], prefix=f"l{layer}." if layer is not None else "")
                b.layer = None
                res = b.op("k3.fused_kda", m.x, *m.weights, *m.gate_w, *m.states,
                           _name=["kda_out", "conv_q_state", "conv_k_state", "conv_v_state", "kda_state"], **attrs)
                rw.replace(m.out, res[0])
                for conv, new in zip(m.conv_ops, res[1:4]):
                    rw.replace(conv.results[1], new)
                rw.replace(m.kda.results[1], res[4])
                for o in m.ops:
                    rw.erase(o)
                count += 1
                modes[attrs["mode"]] += 1
            rw.commit()
            rw.builder.prefix = ""
        return PassResult(rewrites=count, details={"fused": count, "unmatched": skipped, **modes})
