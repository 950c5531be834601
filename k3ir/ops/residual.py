"""Block Attention Residuals (SPEC.md section 2)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, tensor
from ._util import f64, numel


def attn_res_ref(sources, w, r, eps):
    """``score_s = <RMSNorm(v_s) * r, w>``, ``a = softmax_s(score)``, ``mix = sum_s a_s v_s``."""
    V = np.stack([f64(v) for v in sources], axis=-2)              # [..., S, d]
    vn = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps) * f64(r)
    score = np.sum(vn * f64(w).reshape(-1), axis=-1)               # [..., S]
    a = np.exp(score - score.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    return np.sum(a[..., None] * V, axis=-2)


@op("k3.attn_res", "model")
class AttnRes(Op):
    """AttnRes mix (SPEC.md 2): pseudo-query w ``[1,d]`` (or ``[d]``), RMSNorm gain r ``[d]``,
    sources ``[B,T,d]`` (block snapshots then the partial sum). Softmax over sources in fp32,
    no temperature; returns ``[B,T,d]`` (raw sources mixed). Zero w gives the mean."""
    w = Operand()
    r = Operand()
    sources = Operand(variadic=True)
    out = Result()
    eps = Attr(float, 1e-6)

    def infer(self, w, r, sources):
        require(len(sources) >= 1, "attn_res needs at least one source")
        s0 = tensor(sources[0], "source")
        d = s0.shape[-1]
        for s in sources:
            require([str(x) for x in s.shape] == [str(x) for x in s0.shape], f"sources differ: {s} vs {s0}")
        require(w.numel() == int(d) if w.is_static() else False, f"w {w} must hold {d} values")
        require(r.rank == 1 and r.shape[0] == d, f"r {r} must be [{d}]")
        return [s0]

    def reference(self, w, r, *sources):
        return attn_res_ref(sources, w, r, self.eps)

    def decompose(self, b, w, r, sources):
        V = b.concat(*[b.reshape(s, shape=[0, 0, 1, -1]) for s in sources], axis=2)   # [B,T,S,d]
        ms = b.reduce_mean(b.square(V), axes=[-1], keepdims=True)
        vn = b.mul(b.mul(V, b.rsqrt(b.add(ms, self.eps))), r)
        score = b.reduce_sum(b.mul(vn, b.reshape(w, shape=[-1])), axes=[-1])
        a = b.softmax(b.cast(score, dtype="f32"), axis=-1)
        return b.cast(b.einsum(a, V, equation="bts,btsd->btd"), dtype=sources[0].type.dtype)

    def flops(self, ot, rt, env):
        return 6.0 * numel(rt[0].shape, env) * (len(ot) - 2)
