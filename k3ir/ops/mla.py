"""Gated MLA core attention with NoPE (SPEC.md section 4)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, state, tensor
from ..types import StateType
from ._util import f64, numel, op_ref


def mla_ref(q, kv, w_kvb, cache, *, heads, nope, rope, v_dim, scale, absorbed, lengths=None):
    """float64 MLA. q ``[B,T,H,nope+rope]``; kv ``[B,T,R+P]`` = ``[c_kv (normed) | k_rope]``;
    w_kvb ``[H*(nope+v), R]``; cache ``[B,L,R+P]`` or None. Returns (o ``[B,T,H,v]``,
    cache ``[B,L+T,R+P]``). The rope dims are never rotated but are scored (NoPE).
    ``lengths`` (int ``[B]``, optional): row b's cache is right-padded, only its first
    ``lengths[b]`` entries are attended (variable-length batches; padding stays in the result)."""
    q, kv, w = f64(q), f64(kv), f64(w_kvb)
    T = q.shape[1]
    R = w.shape[1]
    full = kv if cache is None else np.concatenate([f64(cache), kv], axis=1)
    S = full.shape[1]
    ckv, kr = full[..., :R], full[..., R:]
    wh = w.reshape(heads, nope + v_dim, R)
    w_uk, w_uv = wh[:, :nope], wh[:, nope:]                      # [H,nope,R], [H,v,R]
    qn, qr = q[..., :nope], q[..., nope:]
    if absorbed:
        qt = np.einsum("bthn,hnr->bthr", qn, w_uk)               # q~ = W_uk^T q_nope
        scores = np.einsum("bthr,bsr->bhts", qt, ckv) + np.einsum("bthp,bsp->bhts", qr, kr)
    else:
        kn = np.einsum("bsr,hnr->bshn", ckv, w_uk)
        scores = np.einsum("bthn,bshn->bhts", qn, kn) + np.einsum("bthp,bsp->bhts", qr, kr)
    scores = scores * scale
    keep = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
    if lengths is not None:
        j = np.arange(S)
        valid = (j[None, :] < np.asarray(lengths)[:, None]) | (j[None, :] >= S - T)      # [B, S]
        keep = keep[None, None] & valid[:, None, None, :]
    scores = np.where(keep, scores, -np.inf)
    a = np.exp(scores - scores.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    if absorbed:
        o_lat = np.einsum("bhts,bsr->bthr", a, ckv)
        o = np.einsum("bthr,hvr->bthv", o_lat, w_uv)
    else:
        vv = np.einsum("bsr,hvr->bshv", ckv, w_uv)
        o = np.einsum("bhts,bshv->bthv", a, vv)
    return o, full


class _MLAAttention(Op):
    """The results and attributes ``k3.mla`` and ``k3.mla_kv_norm`` share (each declares its own operands)."""
    out = Result()
    cache_out = Result()
    heads = Attr(int)
    nope = Attr(int)
    rope = Attr(int)
    v_dim = Attr(int)
    scale = Attr(float)
    absorbed = Attr(bool, False)


@op("k3.mla", "model")
class MLA(_MLAAttention):
    """MLA attention core (SPEC.md 4): q ``[B,T,H,nope+rope]``, kv ``[B,T,R+P]`` (normed c_kv and
    the shared k_rope), w_kvb ``[H*(nope+v), R]``, optional cache ``!mla_cache<R,P>``.
    ``score = (q_nope.k_nope + q_rope.k_rope) * scale`` (NoPE), causal softmax, ``o = sum a v``.
    ``absorbed=True`` folds ``W_uk`` into the query and ``W_uv`` into the output (equal result).
    Returns (o ``[B,T,H,v]``, cache with the T new tokens appended).
    Optional ``lengths`` ``i64[B]`` (needs the cache): row b's cache is right-padded to L and only
    its first ``lengths[b]`` entries are attended (continuous batching of mixed lengths); absent,
    every cached entry counts."""
    q = Operand()
    kv = Operand()
    w_kvb = Operand()
    cache_in = Operand(optional=True)
    lengths = Operand(optional=True)

    def infer(self, q, kv, w, c=None, lengths=None):
        q, kv, w = tensor(q, "q"), tensor(kv, "kv"), tensor(w, "w_kvb")
        H, n, r, vd = self.heads, self.nope, self.rope, self.v_dim
        require(q.rank == 4 and q.shape[2] == H and q.shape[3] == n + r, f"q must be [B,T,{H},{n + r}], got {q}")
        require(w.rank == 2 and w.shape[0] == H * (n + vd), f"w_kvb must be [{H * (n + vd)}, R], got {w}")
        R = int(w.shape[1])
        require(kv.rank == 3 and kv.shape[2] == R + r, f"kv must be [B,T,{R + r}], got {kv}")
        st = StateType("mla_cache", (R, r))
        if c is not None:
            state(c, "mla_cache", "cache_in")
            require(c == st, f"cache {c} does not match {st}")
        if lengths is not None:
            lt = tensor(lengths, "lengths")
            require(lt.rank == 1 and lt.dtype in ("i64", "i32"), f"lengths must be i64[B], got {lt}")
        return [q.with_shape(q.shape[:3] + (vd,)), st]

    def reference(self, q, kv, w, c=None, lengths=None):
        return mla_ref(q, kv, w, c, heads=self.heads, nope=self.nope, rope=self.rope, v_dim=self.v_dim,
                       scale=self.scale, absorbed=self.absorbed, lengths=lengths)

    def decompose(self, b, q, kv, w, c=None, lengths=None):
        H, n, r, vd = self.heads, self.nope, self.rope, self.v_dim
        R = int(w.type.shape[1])
        if c is None:
            c = b.state_zero(q, kind="mla_cache", params=[R, r])
        full = b.concat(b.state_load(c, batch=q.type.shape[0]), b.cast(kv, dtype="f32"), axis=1)
        ckv = b.slice(full, axis=2, start=0, end=R)
        kr = b.slice(full, axis=2, start=R)
        wh = b.reshape(w, shape=[H, n + vd, R])
        w_uk = b.slice(wh, axis=1, start=0, end=n)
        w_uv = b.slice(wh, axis=1, start=n)
        qn = b.slice(q, axis=3, start=0, end=n)
        qr = b.slice(q, axis=3, start=n)
        if self.absorbed:
            qt = b.einsum(qn, w_uk, equation="bthn,hnr->bthr")
            s = b.add(b.einsum(qt, ckv, equation="bthr,bsr->bhts"), b.einsum(qr, kr, equation="bthp,bsp->bhts"))
        else:
            kn = b.einsum(ckv, w_uk, equation="bsr,hnr->bshn")
            s = b.add(b.einsum(qn, kn, equation="bthn,bshn->bhts"), b.einsum(qr, kr, equation="bthp,bsp->bhts"))
        masked = b.causal_mask(b.mul(s, self.scale)) if lengths is None else \
            b.op("k3.causal_mask", b.mul(s, self.scale), lengths)
        a = b.softmax(masked, axis=-1)
        if self.absorbed:
            o = b.einsum(b.einsum(a, ckv, equation="bhts,bsr->bthr"), w_uv, equation="bthr,hvr->bthv")
        else:
            o = b.einsum(a, b.einsum(ckv, w_uv, equation="bsr,hvr->bshv"), equation="bhts,bshv->bthv")
        return b.cast(o, dtype=q.type.dtype), b.state_store(full, kind="mla_cache", params=[R, r])

    def flops(self, ot, rt, env):
        B, T = numel((ot[0].shape[0],), env), numel((ot[0].shape[1],), env)
        L = env.get("L", 0)
        H, n, r, vd = self.heads, self.nope, self.rope, self.v_dim
        R = numel((ot[2].shape[1],), env)
        keys = L + (T + 1) / 2.0                                   # mean causal span per query
        if self.absorbed or env.get("_absorb"):
            per_q = 2 * H * n * R + 2 * H * keys * (R + r) + 2 * H * keys * R + 2 * H * R * vd
            return B * T * per_q
        expand = 2.0 * B * (L + T) * R * H * (n + vd) if L else 2.0 * B * T * R * H * (n + vd)
        return expand + B * T * 2 * H * keys * (n + r + vd)


@op("k3.mla_kv_norm", "fused")
class MLAKVNorm(_MLAAttention):
    """``k3.mla`` whose cache row is built from the raw latent (made by ``fuse-mla-kv-norm`` for absorbed MLA):
    ``kv = concat(rmsnorm(latent, kv_norm, eps), k_rope)`` on the last axis, then ``k3.mla(q, kv, w_kvb,
    cache_in, lengths)`` (SPEC.md 4). latent ``[B,T,R]`` (the ``kv_a`` output's first R columns, before
    ``kv_a_layernorm``), k_rope ``[B,T,P]``, kv_norm ``[R]``; the other operands, attributes and results as
    ``k3.mla``. The Triton decode kernel norms the latent and writes the row in its prologue."""
    q = Operand()
    latent = Operand()
    k_rope = Operand()
    kv_norm = Operand()
    w_kvb = Operand()
    cache_in = Operand(optional=True)
    lengths = Operand(optional=True)
    eps = Attr(float, 1e-6, "kv_a_layernorm eps")

    def _mla(self):
        return MLA({k: v for k, v in self.attrs.items() if k != "eps"})

    def infer(self, q, lat, kr, nw, w, c=None, lengths=None):
        lat, kr, nw = tensor(lat, "latent"), tensor(kr, "k_rope"), tensor(nw, "kv_norm")
        require(lat.rank == 3 and kr.rank == 3 and [str(s) for s in lat.shape[:2]] == [str(s) for s in kr.shape[:2]]
                and lat.dtype == kr.dtype, f"latent {lat} and k_rope {kr} must be [B,T,R] and [B,T,P] of one dtype")
        require(nw.rank == 1 and str(nw.shape[0]) == str(lat.shape[2]), f"kv_norm {nw} must be [{lat.shape[2]}]")
        kv = lat.with_shape(lat.shape[:2] + (int(lat.shape[2]) + int(kr.shape[2]),))
        return self._mla().infer(q, kv, w, c, lengths)

    def reference(self, q, lat, kr, nw, w, c=None, lengths=None):
        normed = op_ref("k3.rmsnorm", {"eps": self.eps}, lat, nw)
        return self._mla().reference(q, np.concatenate([normed, f64(kr)], axis=-1), w, c, lengths)

    def decompose(self, b, q, lat, kr, nw, w, c=None, lengths=None):
        kv = b.concat(b.rmsnorm(lat, nw, eps=self.eps), kr, axis=2)
        attrs = {k: v for k, v in self.attrs.items() if k in MLA._attrs}
        return b.op("k3.mla", q, kv, w, c, lengths, **attrs)

    def flops(self, ot, rt, env):
        return self._mla().flops([ot[0], None, ot[4]], rt, env) + 4.0 * numel(ot[1].shape, env)
