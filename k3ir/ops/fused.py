"""Fused ops created by the optimisation passes (``passes/``): one KDA layer, MoE dispatch /
grouped GEMM / combine, and the AttnRes mix over one stacked snapshot buffer.

Each op's float64 reference composes the references of the ops it replaces, in the same
order, so a fused module equals the unfused one to float64 rounding (SPEC.md 11); each
decomposes back into model/core ops for backends without a kernel.
"""
from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from ..errors import K3BackendError
from ..opdef import Attr, Op, Operand, Result, get_opdef, op, require, tensor
from ..types import StateType, TensorType
from ._util import f64, numel
from .kda import kda_gate_ref, kda_recurrent


def _ref(name: str, attrs: dict, *args):
    """The float64 reference of op ``name`` (used to compose fused references exactly)."""
    return get_opdef(name)(attrs).reference(*args)


# ---- KDA ---------------------------------------------------------------------------------
#: fixed operands of k3.fused_kda before the variadic output-gate weights and states
KDA_WEIGHTS = ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_fa", "w_fb", "A_log", "dt_bias",
               "w_b", "o_norm")


@op("k3.fused_kda", "fused")
class FusedKDA(Op):
    """One whole KDA layer (SPEC.md 3) between the input norm and ``o_proj``.

    Operands: x ``[B,T,d]`` (``input_layernorm`` output); ``w_q, w_k, w_v [H*D, d]``; conv taps
    ``conv_q/k/v [H*D, 1, K]``; ``w_fa [D, d]``, ``w_fb [H*D, D]`` (decay pre-activation);
    ``A_log`` (first H entries per head), ``dt_bias f32[H*D]``; ``w_b [H, d]`` (beta logit);
    ``o_norm [D]``; the output-gate weights (``g_proj [H*D, d]`` when ``full_rank_gate``, else
    ``g_a_proj [D, d]``, ``g_b_proj [H*D, D]``); optionally the four states
    ``!conv_state<H*D,K-1>`` x3 (q, k, v) and ``!kda_state<H,D,D>``.
    Results: ``o [B,T,H*D]`` (gated, normed, before ``o_proj``), new conv states q/k/v, new
    recurrent state (fp32). ``mode="chunk"`` (prefill/forward: chunked WY form, chunk_size) or
    ``"recurrent"`` (decode, T == 1: one delta step with the states in place); both compute the
    same function."""
    x = Operand()
    w_q = Operand()
    w_k = Operand()
    w_v = Operand()
    conv_q = Operand()
    conv_k = Operand()
    conv_v = Operand()
    w_fa = Operand()
    w_fb = Operand()
    A_log = Operand()
    dt_bias = Operand()
    w_b = Operand()
    o_norm = Operand()
    gate_w = Operand("g_proj, or g_a_proj and g_b_proj", variadic=True)
    states = Operand("conv q, k, v and recurrent state (all or none)", variadic=True)
    out = Result()
    conv_q_out = Result()
    conv_k_out = Result()
    conv_v_out = Result()
    state_out = Result()
    heads = Attr(int)
    head_dim = Attr(int)
    scale = Attr(float)
    gate = Attr(str, choices=("lower_bound", "softplus"))
    lower_bound = Attr(float, -5.0)
    full_rank_gate = Attr(bool)
    eps = Attr(float, 1e-6, "head RMSNorm eps (rms_norm_eps)")
    qk_eps = Attr(float, 1e-6, "L2 norm eps of q and k")
    chunk_size = Attr(int, 64)
    mode = Attr(str, "chunk", choices=("chunk", "recurrent"))
    #: whether result 0 has the gated head norm applied (``k3.fused_kda_ungated`` leaves it to its consumer)
    GATED: ClassVar[bool] = True

    @classmethod
    def group_operands(cls, operands):
        n = len(operands)
        fixed = 1 + len(KDA_WEIGHTS)
        require(n in (fixed + 1, fixed + 2, fixed + 5, fixed + 6),
                f"k3.fused_kda takes {fixed} operands, 1-2 gate weights and 0 or 4 states; got {n}")
        n_states = 4 if n >= fixed + 5 else 0
        out = {"x": operands[0]}
        out.update(zip(KDA_WEIGHTS, operands[1:fixed]))
        out["gate_w"] = list(operands[fixed:n - n_states])
        out["states"] = list(operands[n - n_states:])
        return out

    def _split(self, args):
        fixed = 1 + len(KDA_WEIGHTS)
        ng = 1 if self.full_rank_gate else 2
        return args[:fixed], list(args[fixed:fixed + ng]), list(args[fixed + ng:])

    def infer(self, x, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm,
              gate_w, states):
        x = tensor(x, "x")
        H, D = self.heads, self.head_dim
        HD = H * D
        require(x.rank == 3, f"x must be [B,T,d], got {x}")
        d = x.shape[2]
        for name, w, want in (("w_q", w_q, (HD, d)), ("w_k", w_k, (HD, d)), ("w_v", w_v, (HD, d)),
                              ("w_fa", w_fa, (D, d)), ("w_fb", w_fb, (HD, D)), ("w_b", w_b, (H, d)),
                              ("o_norm", o_norm, (D,)), ("dt_bias", dt_bias, (HD,))):
            require([str(s) for s in tensor(w, name).shape] == [str(s) for s in want],
                    f"{name} must be {list(want)}, got {w}")
        K = None
        for name, c in (("conv_q", conv_q), ("conv_k", conv_k), ("conv_v", conv_v)):
            c = tensor(c, name)
            require(c.rank == 3 and c.shape[0] == HD and c.shape[1] == 1, f"{name} must be [{HD},1,K], got {c}")
            require(K is None or c.shape[2] == K, "conv kernels differ")
            K = c.shape[2]
        want_g = [(HD, d)] if self.full_rank_gate else [(D, d), (HD, D)]
        require(len(gate_w) == len(want_g),
                f"full_rank_gate={self.full_rank_gate} wants {len(want_g)} gate weights, got {len(gate_w)}")
        for w, want in zip(gate_w, want_g):
            require([str(s) for s in w.shape] == [str(s) for s in want], f"gate weight must be {list(want)}, got {w}")
        conv_st = StateType("conv_state", (HD, int(K) - 1))
        kda_st = StateType("kda_state", (H, D, D))
        if states:
            require(len(states) == 4, "states: conv q, k, v and the recurrent state, or none")
            for s in states[:3]:
                require(s == conv_st, f"conv state {s} does not match {conv_st}")
            require(states[3] == kda_st, f"state {states[3]} does not match {kda_st}")
        if self.mode == "recurrent":
            require(x.shape[1] == 1, f"mode=recurrent needs T == 1, got {x}")
        return [x.with_shape((x.shape[0], x.shape[1], HD)), conv_st, conv_st, conv_st, kda_st]

    def verify(self):
        require(self.heads > 0 and self.head_dim > 0, "heads and head_dim must be positive")
        require(self.chunk_size > 0 and self.chunk_size % 16 == 0, "chunk_size must be a positive multiple of 16")
        require(self.gate != "lower_bound" or self.lower_bound < 0, f"lower_bound must be negative, got "
                f"{self.lower_bound}")

    def reference(self, *args):
        (x, w_q, w_k, w_v, c_q, c_k, c_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm), gate_w, states = self._split(args)
        H, D = self.heads, self.head_dim
        x = f64(x)
        B, T = x.shape[:2]
        st = list(states) if states else [None] * 4
        ys, new = [], []
        for w, c, s in zip((w_q, w_k, w_v), (c_q, c_k, c_v), st[:3]):
            y, s_new = _ref("k3.short_conv", {"activation": "silu"}, _ref("k3.linear", {}, x, w), c, s)
            ys.append(np.reshape(y, (B, T, H, D)))
            new.append(s_new)
        q = _ref("k3.l2norm", {"eps": self.qk_eps}, ys[0])
        k = _ref("k3.l2norm", {"eps": self.qk_eps}, ys[1])
        z = _ref("k3.linear", {}, _ref("k3.linear", {}, x, w_fa), w_fb)
        g = kda_gate_ref(np.reshape(z, (B, T, H, D)), A_log, dt_bias, self.gate, self.lower_bound)
        beta = _ref("k3.sigmoid", {}, _ref("k3.linear", {}, x, w_b))
        o, s_out = kda_recurrent(q, k, ys[2], g, beta, self.scale, st[3])
        gz = _ref("k3.linear", {}, x, gate_w[0])
        if not self.full_rank_gate:
            gz = _ref("k3.linear", {}, gz, gate_w[1])
        if not self.GATED:             # k3.fused_kda_ungated: o before the gated head norm, and its gate input
            return (np.reshape(o, (B, T, H * D)), *new, s_out, gz)
        o = _ref("k3.gated_rmsnorm", {"eps": self.eps}, o, np.reshape(gz, (B, T, H, D)), o_norm)
        return (np.reshape(o, (B, T, H * D)), *new, s_out)

    def decompose(self, b, x, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_fa, w_fb, A_log, dt_bias, w_b, o_norm,
                  gate_w, states):
        H, D = self.heads, self.head_dim
        st = list(states) if states else [None] * 4
        ys, new = [], []
        for w, c, s in zip((w_q, w_k, w_v), (conv_q, conv_k, conv_v), st[:3]):
            y, s_new = b.op("k3.short_conv", b.linear(x, w), c, s, activation="silu")
            ys.append(b.reshape(y, shape=[0, 0, H, D]))
            new.append(s_new)
        q, k = b.l2norm(ys[0], eps=self.qk_eps), b.l2norm(ys[1], eps=self.qk_eps)
        z = b.reshape(b.linear(b.linear(x, w_fa), w_fb), shape=[0, 0, H, D])
        g = b.kda_gate(z, A_log, dt_bias, form=self.gate, lower_bound=self.lower_bound)
        beta = b.sigmoid(b.cast(b.linear(x, w_b), dtype="f32"))
        o, s_out = b.op("k3.kda", q, k, ys[2], g, beta, st[3], scale=self.scale, chunk_size=self.chunk_size)
        gz = b.linear(x, gate_w[0])
        if not self.full_rank_gate:
            gz = b.linear(gz, gate_w[1])
        if not self.GATED:
            return (b.reshape(o, shape=[0, 0, H * D]), *new, s_out, gz)
        o = b.gated_rmsnorm(o, b.reshape(gz, shape=[0, 0, H, D]), o_norm, eps=self.eps)
        return (b.reshape(o, shape=[0, 0, H * D]), *new, s_out)

    def flops(self, ot, rt, env):
        B, T, d = (numel((s,), env) for s in ot[0].shape)
        H, D = self.heads, self.head_dim
        HD, K = H * D, numel((ot[4].shape[2],), env)
        proj = 3 * HD * d + D * d + HD * D + H * d + (HD * d if self.full_rank_gate else D * d + HD * D)
        return B * T * (2.0 * proj + 2.0 * 3 * HD * K + 8.0 * H * D * D + H)   # + the beta sigmoid


@op("k3.fused_kda_ungated", "fused")
class FusedKDAUngated(FusedKDA):
    """``k3.fused_kda`` with its output norm left to the consumer (made by ``fuse-kda-output`` for a decode
    layer whose output only feeds ``k3.decode_linear``s, which apply it in their prologue: ``norm="gated"``).

    Operands and attributes as ``k3.fused_kda``. Results: o ``[B,T,H*D]`` *before* the per-head gated
    RMSNorm of SPEC.md 3.6, the new conv states q/k/v and recurrent state, then ``gate [B,T,H*D]`` (the
    output-gate pre-activation ``gz``: ``x g_proj^T``, or ``(x g_a^T) g_b^T``). ``k3.gated_rmsnorm`` of
    (o, gate) per head with weight ``o_norm`` and ``eps`` gives ``k3.fused_kda``'s result 0."""
    gate = Result()
    GATED = False

    def infer(self, *args):
        out = super().infer(*args)
        return [*out, out[0]]


# ---- MoE ---------------------------------------------------------------------------------
def capacity_for(tokens: int, top_k: int, num_experts: int, capacity: int, factor: float) -> int:
    """Static per-expert capacity: ``capacity`` if set, else ``ceil(factor * m k / n)`` (the QB
    target load ``m k / n`` times ``factor``, SPEC.md 6); 0 means no static capacity."""
    if capacity > 0:
        return capacity
    if factor <= 0:
        return 0
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def _rows(w: TensorType):
    """The flattened row count ``R`` of ``[B,T,k]``, spelled as ``k3.reshape(shape=[-1])`` does."""
    return get_opdef("k3.reshape")({"shape": [-1]}).infer(w)[0].shape[0]


@op("k3.moe_dispatch", "fused")
class MoEDispatch(Op):
    """Sort the routed copies of the tokens by expert (stable: ties keep token-slot order).

    x ``[B,T,D]``, weights ``f32[B,T,k]`` (combine weights from ``k3.router``), indices
    ``i64[B,T,k]``. Returns ``x_sorted [R,D]`` (``R = B*T*k``; row r is the token of slot
    ``perm[r]``), ``offsets i64[E+1]`` (expert e owns rows ``offsets[e]:offsets[e+1]``),
    ``inv_perm i64[B,T,k]`` (slot -> sorted row) and ``comb_w f32[R]`` (weights in sorted order).
    ``capacity``/``capacity_factor``: a static per-expert row capacity kernels may assume
    (``capacity_for``); when a batch exceeds it the kernels take the exact ragged path, so the
    values never depend on it (no token is dropped)."""
    x = Operand()
    weights = Operand()
    indices = Operand()
    x_sorted = Result()
    offsets = Result()
    inv_perm = Result()
    comb_w = Result()
    num_experts = Attr(int)
    capacity = Attr(int, 0)
    capacity_factor = Attr(float, 0.0)

    def infer(self, x, w, idx):
        x, w, idx = tensor(x, "x"), tensor(w, "weights"), tensor(idx, "indices")
        require(x.rank == 3 and w.rank == 3, f"x {x} and weights {w} must be [B,T,*]")
        require(idx.dtype in ("i64", "i32") and [str(s) for s in idx.shape] == [str(s) for s in w.shape],
                f"indices {idx} must be integer and match weights {w}")
        require([str(s) for s in w.shape[:2]] == [str(s) for s in x.shape[:2]], f"weights {w} do not fit x {x}")
        R = _rows(w)
        return [TensorType(x.dtype, (R, x.shape[2])), TensorType("i64", (self.num_experts + 1,)),
                TensorType("i64", w.shape), TensorType("f32", (R,))]

    def verify(self):
        require(self.num_experts > 0 and self.capacity >= 0 and self.capacity_factor >= 0,
                "num_experts > 0, capacity >= 0 and capacity_factor >= 0")

    def reference(self, x, w, idx):
        x, w = f64(x), f64(w)
        k = w.shape[-1]
        flat = np.asarray(idx, dtype=np.int64).reshape(-1)
        require(flat.size == 0 or (flat.min() >= 0 and flat.max() < self.num_experts), "expert index out of range")
        order = np.argsort(flat, kind="stable")                    # sorted row -> slot
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size)
        counts = np.bincount(flat, minlength=self.num_experts)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        xs = x.reshape(-1, x.shape[-1])[order // k]
        return xs, offsets, inv.reshape(w.shape), w.reshape(-1)[order]

    def decompose(self, b, x, w, idx):
        # shape-polymorphic, O(R^2): sorted positions from one_hot/cumsum per axis, then the
        # sort as a 0/1 permutation matrix (exact in float: each row picks one value)
        E = self.num_experts
        D = x.type.shape[2]
        oh = b.one_hot(idx, depth=E)                                                 # [B,T,k,E]
        tok = b.reduce_sum(oh, axes=[2])                                             # [B,T,E]
        in_tok = b.sub(b.cumsum(oh, axis=2), oh)
        in_row = b.sub(b.cumsum(tok, axis=1), tok)
        row = b.reduce_sum(tok, axes=[1])                                            # [B,E]
        in_batch = b.sub(b.cumsum(row, axis=0), row)
        counts = b.reduce_sum(row, axes=[0])                                         # [E]
        csum = b.cumsum(counts, axis=0)
        rank = b.add(b.add(in_tok, b.reshape(in_row, shape=[0, 0, 1, -1])), b.reshape(in_batch, shape=[0, 1, 1, -1]))
        pos = b.reduce_sum(b.mul(b.add(rank, b.sub(csum, counts)), oh), axes=[-1])  # [B,T,k] slot -> row
        flat = b.reshape(pos, shape=[-1])                                            # [R]
        ar = b.sub(b.cumsum(b.add(b.mul(flat, 0.0), 1.0), axis=0), 1.0)             # arange(R)
        d = b.sub(b.reshape(flat, shape=[1, -1]), b.reshape(ar, shape=[-1, 1]))      # [row, slot]
        P = b.sub(1.0, b.minimum(b.maximum(d, b.neg(d)), 1.0))
        ones = b.add(b.mul(b.reshape(b.cast(w, dtype="f32"), shape=[0, 0, 0, 1]), 0.0), 1.0)   # [B,T,k,1]
        xrep = b.reshape(b.mul(b.reshape(b.cast(x, dtype="f32"), shape=[0, 0, 1, D]), ones), shape=[-1, D])
        xs = b.cast(b.matmul(P, xrep), dtype=x.type.dtype)
        zero = b.reshape(b.mul(b.reduce_sum(counts, axes=[0], keepdims=True), 0.0), shape=[1])
        offsets = b.cast(b.concat(zero, csum, axis=0), dtype="i64")
        comb = b.reshape(b.matmul(P, b.reshape(b.cast(w, dtype="f32"), shape=[-1, 1])), shape=[-1])
        return xs, offsets, b.cast(pos, dtype="i64"), comb


QUANT_FORMATS = ("none", "mxfp4", "int4")


def dequantize(quant: str, packed, scales) -> np.ndarray:
    """Float64 weights from packed codes and group-32 scales (SPEC.md 7) via ``k3ir.quant``."""
    from .. import quant as q
    if quant == "mxfp4":
        return q.mxfp4_dequantize(np.asarray(packed).astype(np.uint8), np.asarray(scales).astype(np.uint8))
    return q.int4_dequantize(np.asarray(packed).astype(np.int64).astype(np.int32), np.asarray(scales))


@op("k3.grouped_matmul", "fused")
class GroupedMatmul(Op):
    """All experts in one op: ``y[r] = x[r] W_e^T`` for the rows ``offsets[e]:offsets[e+1]``.

    x ``[R,K]`` (sorted by expert), offsets ``i64[E+1]``, w ``[E,N,K]`` (``quant="none"``) or
    packed ``mxfp4[E,N,K]`` / ``int4[E,N,K]`` (run-time arrays ``u8[E,N,K/2]`` / ``i32[E,N,K/8]``)
    with ``scales [E,N,K/32]`` (E8M0 bytes / float). Returns ``[R,N]`` in x's dtype; a quantised
    product equals dequantise-then-matmul (SPEC.md 7). ``capacity``: see ``k3.moe_dispatch``."""
    x = Operand()
    offsets = Operand()
    w = Operand()
    scales = Operand(optional=True)
    out = Result()
    quant = Attr(str, "none", choices=QUANT_FORMATS)
    capacity = Attr(int, 0)
    capacity_factor = Attr(float, 0.0)

    def infer(self, x, offsets, w, scales=None):
        x, w = tensor(x, "x"), tensor(w, "w")
        require(x.rank == 2, f"x must be [R,K], got {x}")
        require(offsets.dtype in ("i64", "i32") and offsets.rank == 1, f"offsets must be integer [E+1], got {offsets}")
        require(w.rank == 3 and str(w.shape[2]) == str(x.shape[1]), f"w {w} must be [E,N,{x.shape[1]}]")
        require(isinstance(offsets.shape[0], str) or offsets.shape[0] == int(w.shape[0]) + 1,
                f"offsets {offsets} must be [E+1] for w {w}")
        if self.quant == "none":
            require(scales is None, "quant=none takes no scales")
        else:
            require(w.dtype == self.quant, f"quant={self.quant} needs w typed {self.quant}, got {w}")
            require(scales is not None and scales.rank == 3 and scales.shape[:2] == w.shape[:2]
                    and int(scales.shape[2]) * 32 == int(w.shape[2]), f"scales must be [E,N,K/32], got {scales}")
        return [TensorType(x.dtype, (x.shape[0], w.shape[1]))]

    def reference(self, x, offsets, w, scales=None):
        x = f64(x)
        W = f64(w) if self.quant == "none" else dequantize(self.quant, w, scales)
        off = np.asarray(offsets, dtype=np.int64)
        y = np.zeros((x.shape[0], W.shape[1]))
        for e in range(W.shape[0]):
            if off[e + 1] > off[e]:
                y[off[e]:off[e + 1]] = x[off[e]:off[e + 1]] @ W[e].T
        return y

    def decompose(self, b, x, offsets, w, scales=None):
        if self.quant != "none":
            raise K3BackendError(f"k3.grouped_matmul with quant={self.quant} has no decomposition (needs bit "
                                 "unpacking): this target must lower it, or compile with --quantize none")
        E = int(w.type.shape[0])
        off = b.cast(offsets, dtype="f32")
        ar = b.sub(b.cumsum(b.add(b.mul(b.reduce_sum(b.cast(x, dtype="f32"), axes=[1]), 0.0), 1.0), axis=0), 1.0)
        lo = b.reshape(b.slice(off, axis=0, start=0, end=E), shape=[1, E])
        hi = b.reshape(b.slice(off, axis=0, start=1), shape=[1, E])
        r = b.reshape(ar, shape=[-1, 1])
        # [lo <= r < hi] for integers: clamp(r - lo + 1, 0, 1) * clamp(hi - r, 0, 1)
        ge = b.minimum(b.maximum(b.add(b.sub(r, lo), 1.0), 0.0), 1.0)
        lt = b.minimum(b.maximum(b.sub(hi, r), 0.0), 1.0)
        sel = b.mul(ge, lt)                                                          # [R,E]
        y = b.einsum(sel, b.cast(x, dtype="f32"), b.cast(w, dtype="f32"), equation="re,rk,enk->rn")
        return b.cast(y, dtype=x.type.dtype)

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[0].shape, env) * numel((ot[0].shape[1],), env)


@op("k3.moe_combine", "fused")
class MoECombine(Op):
    """Weighted un-permute: ``out[t] = sum_j comb_w[inv[t,j]] * y[inv[t,j]]``.
    y ``[R,D]`` (expert outputs in sorted order), comb_w ``f32[R]``, inv_perm ``i64[B,T,k]``.
    Returns ``[B,T,D]`` in y's dtype."""
    y = Operand()
    comb_w = Operand()
    inv_perm = Operand()
    out = Result()

    def infer(self, y, comb_w, inv):
        y, inv = tensor(y, "y"), tensor(inv, "inv_perm")
        require(y.rank == 2 and comb_w.rank == 1, f"y {y} must be [R,D], comb_w [R]")
        require(inv.rank == 3 and inv.dtype in ("i64", "i32"), f"inv_perm must be integer [B,T,k], got {inv}")
        return [TensorType(y.dtype, (inv.shape[0], inv.shape[1], y.shape[1]))]

    def reference(self, y, comb_w, inv):
        y, c = f64(y), f64(comb_w)
        inv = np.asarray(inv, dtype=np.int64)
        return np.sum(c[inv][..., None] * y[inv], axis=-2)

    def decompose(self, b, y, comb_w, inv):
        rows = b.take(y, inv)                                                      # [B,T,k,D]
        w = b.reshape(b.take(b.reshape(comb_w, shape=[-1, 1]), inv), shape=[0, 0, -1])   # [B,T,k]
        return b.cast(b.einsum(w, rows, equation="btk,btkd->btd"), dtype=y.type.dtype)


# ---- AttnRes -------------------------------------------------------------------------------
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
