"""Router and routed experts (SPEC.md sections 5-6), and the fused MoE ops the passes make: dispatch, grouped GEMM
over all experts, combine (SPEC.md 5-7)."""
from __future__ import annotations

import math

import numpy as np

from ..errors import K3BackendError
from ..opdef import Attr, Op, Operand, Result, get_opdef, op, require, tensor
from ..types import TensorType
from ._util import f64, numel, sigmoid, silu


def router_ref(x, w, bias, top_k, renormalize=True, scaling=1.0, eps=1e-20):
    """SPEC.md 5: ``s = sigmoid(x W^T)``; select ``top-k(s + bias)`` (ties: lower index first);
    weights from the unbiased ``s``: ``s_j / (sum_sel s + eps) * scaling``.
    Returns (weights ``[..., k]``, indices ``[..., k]``, scores ``[..., E]``)."""
    s = sigmoid(f64(x) @ f64(w).T)
    biased = s + f64(bias)
    idx = np.argsort(-biased, axis=-1, kind="stable")[..., :top_k]
    sel = np.take_along_axis(s, idx, axis=-1)
    if renormalize:
        sel = sel / (sel.sum(-1, keepdims=True) + eps)
    return sel * scaling, idx.astype(np.int64), s


def situ(g, u, b1, b2):
    return b1 * np.tanh(g / b1) * sigmoid(g) * (b2 * np.tanh(u / b2))


class _Routing(Op):
    """The operands, results and attributes ``k3.router`` and ``k3.moe_front`` share (SPEC.md 5); each op
    declares the rest. ``router_attrs`` are the attributes a ``k3.router`` of the same routing takes."""
    x = Operand()
    weight = Operand()
    bias = Operand()
    weights = Result()
    indices = Result()
    scores = Result()
    top_k = Attr(int)
    renormalize = Attr(bool, True)
    routed_scaling_factor = Attr(float, 1.0)
    eps = Attr(float, 1e-20, "added to the sum of the selected scores (renormalize)")

    def router_attrs(self) -> dict:
        return {k: getattr(self, k) for k in _Routing._attrs}


@op("k3.router", "model")
class Router(_Routing):
    """MoE router (fp32): x ``[B,T,d]``, weight ``[E,d]``, bias ``[E]`` (QB / e_score_correction).
    Returns (weights ``f32[B,T,k]``, indices ``i64[B,T,k]``, scores ``f32[B,T,E]``)."""

    def infer(self, x, w, bias):
        x, w, bias = tensor(x, "x"), tensor(w, "weight"), tensor(bias, "bias")
        require(w.rank == 2 and str(w.shape[1]) == str(x.shape[-1]), f"router weight {w} does not fit {x}")
        E = w.shape[0]
        require(bias.rank == 1 and bias.shape[0] == E, f"bias must be [{E}], got {bias}")
        require(0 < self.top_k <= int(E), f"top_k={self.top_k} not in 1..{E}")
        lead = x.shape[:-1]
        return [TensorType("f32", lead + (self.top_k,)), TensorType("i64", lead + (self.top_k,)),
                TensorType("f32", lead + (E,))]

    def reference(self, x, w, bias):
        return router_ref(x, w, bias, self.top_k, self.renormalize, self.routed_scaling_factor, self.eps)

    def decompose(self, b, x, w, bias):
        s = b.sigmoid(b.matmul(b.cast(x, dtype="f32"), b.transpose(b.cast(w, dtype="f32"), perm=[1, 0])))
        _, idx = b.topk(b.add(s, bias), k=self.top_k)
        sel = b.gather(s, idx, axis=-1)
        if self.renormalize:
            sel = b.div(sel, b.add(b.reduce_sum(sel, axes=[-1], keepdims=True), self.eps))
        return b.mul(sel, self.routed_scaling_factor), idx, s

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[2].shape, env) * numel((ot[1].shape[1],), env)


@op("k3.moe", "model")
class MoE(Op):
    """Routed experts: ``y = sum_j w_j E_{idx_j}(x)`` with each expert a GLU
    ``w2 act(w1 x, w3 x)``; x ``[B,T,D]`` (the latent in K3), weights ``f32[B,T,k]``, indices
    ``i64[B,T,k]``, w1/w3 ``[E,I,D]`` (gate/up), w2 ``[E,D,I]`` (down). ``act``: ``situ`` (SiTU-GLU,
    betas b1/b2) or ``silu`` (SwiGLU). Returns ``[B,T,D]``."""
    x = Operand()
    weights = Operand()
    indices = Operand()
    w1 = Operand()
    w3 = Operand()
    w2 = Operand()
    out = Result()
    act = Attr(str, "situ", choices=("situ", "silu"))
    b1 = Attr(float, 4.0)
    b2 = Attr(float, 25.0)

    def infer(self, x, wts, idx, w1, w3, w2):
        x = tensor(x, "x")
        require(w1.rank == 3 and str(w1.shape[2]) == str(x.shape[-1]), f"w1 {w1} must be [E,I,{x.shape[-1]}]")
        require(w3.shape == w1.shape, f"w3 {w3} must match w1 {w1}")
        require(w2.rank == 3 and w2.shape[0] == w1.shape[0] and str(w2.shape[1]) == str(x.shape[-1])
                and w2.shape[2] == w1.shape[1], f"w2 {w2} must be [E,{x.shape[-1]},{w1.shape[1]}]")
        require(idx.dtype in ("i64", "i32") and [str(d) for d in idx.shape] == [str(d) for d in wts.shape],
                f"indices {idx} and weights {wts} must agree")
        return [x]

    def expert(self, x, w1, w3, w2):
        g, u = x @ w1.T, x @ w3.T
        h = situ(g, u, self.b1, self.b2) if self.act == "situ" else silu(g) * u
        return h @ w2.T

    def reference(self, x, wts, idx, w1, w3, w2):
        x, wts, idx = f64(x), f64(wts), np.asarray(idx, dtype=np.int64)
        w1, w3, w2 = f64(w1), f64(w3), f64(w2)
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1])
        wf, jf = wts.reshape(-1, wts.shape[-1]), idx.reshape(-1, idx.shape[-1])
        out = np.zeros_like(xf)
        for e in np.unique(jf):
            rows, slots = np.nonzero(jf == e)
            out[rows] += wf[rows, slots, None] * self.expert(xf[rows], w1[e], w3[e], w2[e])
        return out.reshape(*lead, x.shape[-1])

    def decompose(self, b, x, wts, idx, w1, w3, w2):
        E = int(w1.type.shape[0])
        comb = b.einsum(b.one_hot(idx, depth=E), wts, equation="btke,btk->bte")
        g = b.einsum(x, w1, equation="btd,eid->btei")
        u = b.einsum(x, w3, equation="btd,eid->btei")
        h = b.situ_glu(g, u, b1=self.b1, b2=self.b2) if self.act == "situ" else b.swiglu(g, u)
        y = b.einsum(h, w2, equation="btei,edi->bted")
        return b.cast(b.einsum(y, comb, equation="bted,bte->btd"), dtype=x.type.dtype)

    def flops(self, ot, rt, env):
        tokens = numel(ot[0].shape[:-1], env)
        k = numel((ot[1].shape[-1],), env)
        D, I = numel((ot[3].shape[2],), env), numel((ot[3].shape[1],), env)
        return tokens * k * (6.0 * D * I + 8.0 * I)


# ---- fused MoE (made by passes/fuse_moe*.py) -----------------------------------------------------------
# Fused ops are made by the fusion passes (passes/); each one's float64 reference composes the references of
# the ops it replaces, in the same order, so a fused module equals the unfused one to float64 rounding
# (SPEC.md 11); each decomposes back into model/core ops for backends without a kernel.
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


class _DispatchAttrs(Op):
    """The attributes ``k3.moe_dispatch`` and ``k3.moe_front`` share, and their check; ``dispatch_attrs`` are
    the attributes a ``k3.moe_dispatch`` of the same dispatch takes."""
    num_experts = Attr(int)
    capacity = Attr(int, 0)
    capacity_factor = Attr(float, 0.0)

    def verify(self):
        require(self.num_experts > 0 and self.capacity >= 0 and self.capacity_factor >= 0,
                "num_experts > 0, capacity >= 0 and capacity_factor >= 0")

    def dispatch_attrs(self) -> dict:
        return {k: getattr(self, k) for k in _DispatchAttrs._attrs}


@op("k3.moe_dispatch", "fused")
class MoEDispatch(_DispatchAttrs):
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

    def infer(self, x, w, idx):
        x, w, idx = tensor(x, "x"), tensor(w, "weights"), tensor(idx, "indices")
        require(x.rank == 3 and w.rank == 3, f"x {x} and weights {w} must be [B,T,*]")
        require(idx.dtype in ("i64", "i32") and [str(s) for s in idx.shape] == [str(s) for s in w.shape],
                f"indices {idx} must be integer and match weights {w}")
        require([str(s) for s in w.shape[:2]] == [str(s) for s in x.shape[:2]], f"weights {w} do not fit x {x}")
        R = _rows(w)
        return [TensorType(x.dtype, (R, x.shape[2])), TensorType("i64", (self.num_experts + 1,)),
                TensorType("i64", w.shape), TensorType("f32", (R,))]

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


# ---- MoE decode-step ops (made by passes/fuse_moe_experts.py and passes/fuse_moe_front.py, triton pipeline's
# ``decode`` phase): what the Triton decode kernels compute in one launch each, declared so --dump-ir shows it ----
def _glu_ref(act: str, g, u, b1: float, b2: float):
    return situ(g, u, b1, b2) if act == "situ" else silu(g) * u


def _same(a, b) -> bool:
    return [str(s) for s in a.shape] == [str(s) for s in b.shape]


@op("k3.moe_experts", "fused")
class MoEExperts(Op):
    """The routed experts of a MoE layer after its dispatch in one op (made by ``fuse-moe-experts``; SPEC.md 5,
    quantised weights SPEC.md 7): ``glu``: ``h = act(rows W1_e^T, rows W3_e^T)`` per expert e (the rows
    ``offsets[e]:offsets[e+1]``; act ``situ`` (SiTU-GLU, betas b1/b2) or ``silu`` (SwiGLU)), else ``h = rows``
    (the GLU rows an earlier op computed: ``k3.moe_front`` with ``routed_glu``); then (``down``) ``y[r] =
    comb_w[r] * (h[r] W2_e^T)``; ``combine``: the result is ``out[t] = sum_j y[inv[t, j]]`` ``[B,T,N]``
    (``k3.moe_combine``), else the scaled rows ``y [R,N]``, which a ``k3.decode_linear`` with ``combine`` sums
    into its epilogue. ``down=False`` (with ``glu``, without ``combine``): the result is h ``[R,I]`` (a GLU whose
    down projection is not followed by the combine, e.g. across the all-to-all of expert parallelism).

    rows ``[R,K]`` (float, sorted by expert: ``k3.moe_dispatch``'s x_sorted), offsets ``i64[E+1]``; ``args``:
    (glu) w1, w3 ``[E,I,K]``, then (down) w2 ``[E,N,I]``, each followed by its scales ``[E,*,*/32]`` when
    ``quant`` is not ``none`` (packed as ``k3.grouped_matmul``), then (down) comb_w ``f32[R]``, then (combine)
    inv_perm ``i64[B,T,k]``.
    Results in rows' dtype. Equal to its decomposition (grouped_matmul, situ_glu/swiglu, grouped_matmul,
    moe_combine, or the row scale) in float64."""
    rows = Operand()
    offsets = Operand()
    args = Operand("expert weights (and scales), comb_w, inv_perm", variadic=True)
    out = Result()
    glu = Attr(bool, True, "gate/up GLU here (False: rows are the GLU rows already)")
    down = Attr(bool, True, "the down GEMM with the combine weight (False: the GLU rows are the result)")
    combine = Attr(bool, True, "un-permute and sum (False: the scaled rows, for a decode_linear epilogue)")
    act = Attr(str, "situ", choices=("situ", "silu"))
    b1 = Attr(float, 4.0)
    b2 = Attr(float, 25.0)
    quant = Attr(str, "none", choices=QUANT_FORMATS)

    def verify(self):
        require(self.down or (self.glu and not self.combine), "down=False keeps only the gate/up GLU: it needs "
                                                              "glu=True and combine=False")

    def parts(self, args):
        """([(w, scales or None)] gate, up (glu) and down (down), comb_w or None, inv_perm or None) of the flat
        ``args``."""
        self.verify()
        per = 1 if self.quant == "none" else 2
        nw = (2 if self.glu else 0) + (1 if self.down else 0)
        want = nw * per + int(self.down) + int(self.combine)
        require(len(args) == want, f"k3.moe_experts takes {nw} expert weights{' with scales' if per == 2 else ''}"
                                   f"{', comb_w' if self.down else ''}{' and inv_perm' if self.combine else ''} "
                                   f"after rows and offsets; got {len(args)} operands")
        ws = [(args[i * per], args[i * per + 1] if per == 2 else None) for i in range(nw)]
        return ws, (args[nw * per] if self.down else None), (args[nw * per + 1] if self.combine else None)

    def _gm(self):
        return get_opdef("k3.grouped_matmul")({"quant": self.quant})

    def infer(self, rows, offsets, args):
        rows = tensor(rows, "rows")
        require(rows.rank == 2, f"rows must be [R,K], got {rows}")
        ws, cw, inv = self.parts(args)
        gm = self._gm()
        h = rows
        if self.glu:
            g = gm.infer(rows, offsets, *[w for w in ws[0] if w is not None])[0]
            u = gm.infer(rows, offsets, *[w for w in ws[1] if w is not None])[0]
            require(_same(g, u), f"gate {ws[0][0]} and up {ws[1][0]} differ")
            h = g
        if not self.down:
            return [h]
        y = gm.infer(h, offsets, *[w for w in ws[-1] if w is not None])[0]
        cw = tensor(cw, "comb_w")
        require(cw.rank == 1 and str(cw.shape[0]) == str(rows.shape[0]), f"comb_w must be [{rows.shape[0]}], got {cw}")
        if not self.combine:
            return [y]
        return get_opdef("k3.moe_combine")({}).infer(y, cw, tensor(inv, "inv_perm"))

    def reference(self, rows, offsets, *args):
        ws, cw, inv = self.parts(args)
        gm = self._gm()
        h = f64(rows)
        if self.glu:
            h = _glu_ref(self.act, gm.reference(h, offsets, *[w for w in ws[0] if w is not None]),
                         gm.reference(h, offsets, *[w for w in ws[1] if w is not None]), self.b1, self.b2)
        if not self.down:
            return h
        y = gm.reference(h, offsets, *[w for w in ws[-1] if w is not None]) * f64(cw)[:, None]
        if not self.combine:
            return y
        return np.sum(y[np.asarray(inv, dtype=np.int64)], axis=-2)

    def decompose(self, b, rows, offsets, args):
        ws, cw, inv = self.parts(args)
        h = rows
        if self.glu:
            g = b.op("k3.grouped_matmul", rows, offsets, *ws[0], quant=self.quant)
            u = b.op("k3.grouped_matmul", rows, offsets, *ws[1], quant=self.quant)
            h = b.situ_glu(g, u, b1=self.b1, b2=self.b2) if self.act == "situ" else b.swiglu(g, u)
        if not self.down:
            return h
        y = b.op("k3.grouped_matmul", h, offsets, *ws[-1], quant=self.quant)
        if self.combine:
            return b.moe_combine(y, cw, inv)
        return b.cast(b.mul(b.cast(y, dtype="f32"), b.reshape(cw, shape=[-1, 1])), dtype=rows.type.dtype)

    def flops(self, ot, rt, env):
        R, K = numel((ot[0].shape[0],), env), numel((ot[0].shape[1],), env)
        ws = ot[2:]
        per = 1 if self.quant == "none" else 2
        if self.down:
            w2 = ws[(2 if self.glu else 0) * per]
            N, I = numel((w2.shape[1],), env), numel((w2.shape[2],), env)
        else:
            N, I = 0, numel((ws[0].shape[1],), env)
        return R * (2.0 * N * I + (4.0 * I * K + 8.0 * I if self.glu else 0.0))


#: the decode MoE front's prologue norms (``k3.moe_front`` ``norm``)
FRONT_NORMS = ("none", "rms")


@op("k3.moe_front", "fused")
class MoEFront(_DispatchAttrs, _Routing):
    """A MoE layer's front in one op (made by ``fuse-moe-front``; SPEC.md 5): ``x' = rmsnorm(x, w_norm)``
    (``norm="rms"``, eps ``norm_eps``; SPEC.md 1) or x, then ``k3.router`` and ``k3.moe_dispatch`` of x',
    optionally the shared expert's SwiGLU ``silu(x' Ws1^T) * (x' Ws3^T)`` (``shared_glu``) and the routed experts'
    gate/up GLU of the sorted rows (``routed_glu``: result 3 is ``act(x_sorted W1_e^T, x_sorted W3_e^T)``, act
    situ/silu as ``k3.moe_experts``, instead of x_sorted).

    x ``[B,T,D]``, router weight ``[E,D]``, bias ``[E]``; ``args``: (norm rms) w_norm ``[D]``, (shared_glu)
    Ws1, Ws3 ``[NS,D]``, (routed_glu) W1, W3 ``[E,I,D]`` (unquantised). Results: router weights ``f32[B,T,k]``,
    indices ``i64[B,T,k]``, scores ``f32[B,T,E]``; x_sorted ``[R,D]`` (or the GLU rows ``[R,I]``), offsets
    ``i64[E+1]``, inv_perm ``i64[B,T,k]``, comb_w ``f32[R]`` (``R = B*T*k``, as ``k3.moe_dispatch``); (shared_glu)
    ``[B,T,NS]``; float results in x's dtype. Equal to its decomposition in float64."""
    args = Operand("norm weight, shared gate/up, routed gate/up", variadic=True)
    rows = Result("x_sorted, or the routed GLU rows")
    offsets = Result()
    inv_perm = Result()
    comb_w = Result()
    norm = Attr(str, "none", choices=FRONT_NORMS)
    norm_eps = Attr(float, 1e-6)
    shared_glu = Attr(bool, False, "the shared expert's SwiGLU gate/up of x' (last result)")
    routed_glu = Attr(bool, False, "result 3 is the routed experts' GLU of the sorted rows")
    act = Attr(str, "silu", choices=("situ", "silu"))
    b1 = Attr(float, 4.0)
    b2 = Attr(float, 25.0)

    def parts(self, args):
        """(w_norm or None, (Ws1, Ws3) or None, (W1, W3) or None) of the flat ``args``."""
        n = (self.norm == "rms") + 2 * self.shared_glu + 2 * self.routed_glu
        require(len(args) == n, f"k3.moe_front with norm={self.norm}, shared_glu={self.shared_glu}, "
                                f"routed_glu={self.routed_glu} takes {n} operands after x, weight and bias; "
                                f"got {len(args)}")
        i = int(self.norm == "rms")
        nw = args[0] if i else None
        shared = tuple(args[i:i + 2]) if self.shared_glu else None
        i += 2 * self.shared_glu
        routed = tuple(args[i:i + 2]) if self.routed_glu else None
        return nw, shared, routed

    def _router(self):
        return Router(self.router_attrs())

    def _dispatch(self):
        return MoEDispatch(self.dispatch_attrs())

    def infer(self, x, w, bias, args):
        x = tensor(x, "x")
        self.verify()
        nw, shared, routed = self.parts(args)
        D = str(x.shape[-1])
        if nw is not None:
            require(tensor(nw, "norm weight").rank == 1 and str(nw.shape[0]) == D, f"norm weight {nw} must be [{D}]")
        rt = self._router().infer(x, w, bias)
        require(str(rt[2].shape[-1]) == str(self.num_experts),
                f"router weight {w} has {rt[2].shape[-1]} experts, num_experts={self.num_experts}")
        dt = self._dispatch().infer(x, rt[0], rt[1])
        if routed is not None:
            w1, w3 = tensor(routed[0], "routed gate"), tensor(routed[1], "routed up")
            require(w1.rank == 3 and _same(w1, w3) and str(w1.shape[0]) == str(self.num_experts)
                    and str(w1.shape[2]) == D, f"routed gate/up {w1}, {w3} must be [{self.num_experts},I,{D}]")
            dt[0] = dt[0].with_shape((dt[0].shape[0], w1.shape[1]))
        out = [*rt, *dt]
        if shared is not None:
            s1, s3 = tensor(shared[0], "shared gate"), tensor(shared[1], "shared up")
            require(s1.rank == 2 and _same(s1, s3) and str(s1.shape[1]) == D,
                    f"shared gate/up {s1}, {s3} must be [NS,{D}]")
            out.append(x.with_shape(x.shape[:-1] + (s1.shape[0],)))
        return out

    def reference(self, x, w, bias, *args):
        nw, shared, routed = self.parts(args)
        x = f64(x)
        if nw is not None:
            x = get_opdef("k3.rmsnorm")({"eps": self.norm_eps}).reference(x, nw)
        rw, ri, rs = self._router().reference(x, w, bias)
        xs, off, inv, cw = self._dispatch().reference(x, rw, ri)
        if routed is not None:
            gm = get_opdef("k3.grouped_matmul")({})
            xs = _glu_ref(self.act, gm.reference(xs, off, routed[0]), gm.reference(xs, off, routed[1]),
                          self.b1, self.b2)
        out = [rw, ri, rs, xs, off, inv, cw]
        if shared is not None:
            out.append(silu(x @ f64(shared[0]).T) * (x @ f64(shared[1]).T))
        return tuple(out)

    def decompose(self, b, x, w, bias, args):
        nw, shared, routed = self.parts(args)
        if nw is not None:
            x = b.rmsnorm(x, nw, eps=self.norm_eps)
        rw, ri, rs = b.router(x, w, bias, **self.router_attrs())
        xs, off, inv, cw = b.moe_dispatch(x, rw, ri, **self.dispatch_attrs())
        if routed is not None:
            g = b.grouped_matmul(xs, off, routed[0])
            u = b.grouped_matmul(xs, off, routed[1])
            xs = b.situ_glu(g, u, b1=self.b1, b2=self.b2) if self.act == "situ" else b.swiglu(g, u)
        out = [rw, ri, rs, xs, off, inv, cw]
        if shared is not None:
            out.append(b.op("k3.decode_linear", x, *shared, glu=True))
        return tuple(out)

    def flops(self, ot, rt, env):
        tokens = numel(ot[0].shape[:-1], env)
        D, E = numel((ot[0].shape[-1],), env), numel((ot[1].shape[0],), env)
        k = numel((rt[0].shape[-1],), env)
        total = 2.0 * tokens * D * E
        if self.shared_glu:
            total += 4.0 * tokens * D * numel((rt[-1].shape[-1],), env)
        if self.routed_glu:
            total += 4.0 * tokens * k * D * numel((rt[3].shape[-1],), env)
        return total
