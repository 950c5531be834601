"""Block Attention Residuals (SPEC.md section 2), and the fused AttnRes pair the passes make (snapshot store, mix over
one stacked buffer)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, tensor
from ._util import f64, numel
from ._util import op_ref as _ref


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


# ---- fused AttnRes (made by passes/fuse_attn_res.py) --------------------------------------------------
# Fused ops are made by the fusion passes (passes/); each one's float64 reference composes the references of
# the ops it replaces, in the same order, so a fused module equals the unfused one to float64 rounding
# (SPEC.md 11); each decomposes back into model/core ops for backends without a kernel.
@op("k3.attn_res_store", "fused")
class AttnResStore(Op):
    """Write block snapshot v ``[B,T,d]`` into slot ``slot`` of the stacked buffer
    ``[B,T,slots,d]`` (a new zero buffer when ``buf`` is absent). Returns the buffer."""
    v = Operand()
    buf = Operand(optional=True)
    out = Result()
    slot = Attr(int)
    slots = Attr(int)

    def infer(self, v, buf=None):
        v = tensor(v, "v")
        require(v.rank == 3, f"snapshot must be [B,T,d], got {v}")
        t = v.with_shape((v.shape[0], v.shape[1], self.slots, v.shape[2]))
        if buf is not None:
            require([str(s) for s in buf.shape] == [str(s) for s in t.shape], f"buffer {buf} must be {t}")
        return [t]

    def verify(self):
        require(0 <= self.slot < self.slots, f"slot {self.slot} not in 0..{self.slots - 1}")

    def reference(self, v, buf=None):
        v = f64(v)
        out = np.zeros(v.shape[:2] + (self.slots, v.shape[2])) if buf is None else f64(buf).copy()
        out[:, :, self.slot] = v
        return out

    def decompose(self, b, v, buf=None):
        vv = b.reshape(v, shape=[0, 0, 1, -1])
        if buf is None:
            buf = b.mul(b.concat(*([vv] * self.slots), axis=2), 0.0)
        parts = []
        if self.slot > 0:
            parts.append(b.slice(buf, axis=2, start=0, end=self.slot))
        parts.append(b.cast(vv, dtype=buf.type.dtype))
        if self.slot + 1 < self.slots:
            parts.append(b.slice(buf, axis=2, start=self.slot + 1))
        return parts[0] if len(parts) == 1 else b.concat(*parts, axis=2)


@op("k3.attn_res_fused", "fused")
class AttnResFused(Op):
    """AttnRes mix (SPEC.md 2) over the first ``n_blocks`` snapshots of the stacked buffer
    ``[B,T,S,d]`` and the partial sum ``pref [B,T,d]``: one op reading one buffer.
    w ``[1,d]``, r ``[d]``; returns ``[B,T,d]``."""
    w = Operand()
    r = Operand()
    buf = Operand()
    pref = Operand()
    out = Result()
    n_blocks = Attr(int)
    eps = Attr(float, 1e-6)

    def infer(self, w, r, buf, pref):
        pref, buf = tensor(pref, "pref"), tensor(buf, "buf")
        require(buf.rank == 4 and 0 < self.n_blocks <= int(buf.shape[2]), f"buffer {buf} lacks {self.n_blocks} slots")
        d = pref.shape[-1]
        require(str(buf.shape[3]) == str(d), f"buffer {buf} does not fit {pref}")
        require(w.is_static() and w.numel() == int(d), f"w {w} must hold {d} values")
        require(r.rank == 1 and r.shape[0] == d, f"r {r} must be [{d}]")
        return [pref]

    def reference(self, w, r, buf, pref):
        buf = f64(buf)
        sources = [buf[:, :, i] for i in range(self.n_blocks)] + [f64(pref)]
        return _ref("k3.attn_res", {"eps": self.eps}, w, r, *sources)

    def decompose(self, b, w, r, buf, pref):
        blocks = b.slice(buf, axis=2, start=0, end=self.n_blocks)
        V = b.concat(blocks, b.cast(b.reshape(pref, shape=[0, 0, 1, -1]), dtype=buf.type.dtype), axis=2)
        ms = b.reduce_mean(b.square(V), axes=[-1], keepdims=True)
        vn = b.mul(b.mul(V, b.rsqrt(b.add(ms, self.eps))), r)
        score = b.reduce_sum(b.mul(vn, b.reshape(w, shape=[-1])), axes=[-1])
        a = b.softmax(b.cast(score, dtype="f32"), axis=-1)
        return b.cast(b.einsum(a, V, equation="bts,btsd->btd"), dtype=pref.type.dtype)

    def flops(self, ot, rt, env):
        return 6.0 * numel(rt[0].shape, env) * (self.n_blocks + 1)
