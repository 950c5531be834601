"""Router and routed experts (SPEC.md sections 5-6)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, tensor
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


@op("k3.router", "model")
class Router(Op):
    """MoE router (fp32): x ``[B,T,d]``, weight ``[E,d]``, bias ``[E]`` (QB / e_score_correction).
    Returns (weights ``f32[B,T,k]``, indices ``i64[B,T,k]``, scores ``f32[B,T,E]``)."""
    x = Operand()
    weight = Operand()
    bias = Operand()
    weights = Result()
    indices = Result()
    scores = Result()
    top_k = Attr(int)
    renormalize = Attr(bool, True)
    routed_scaling_factor = Attr(float, 1.0)
    eps = Attr(float, 1e-20)

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


def expert_load(indices, num_experts: int) -> np.ndarray:
    """Tokens routed to each expert: indices ``[..., k]`` -> ``[E]`` counts."""
    return np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)


def qb_update(scores, bias, top_k: int, rule: str = "quantile", sign_step: float = 1e-3) -> np.ndarray:
    """One Quantile Balancing update of the selection bias (SPEC.md 6), float64.

    scores ``[m, n]`` (router sigmoid scores of one step, m tokens), bias ``[n]``.
    ``quantile``: ``c_j = b_j - Q_{1-k/n}(s_:j + b_j)`` (NumPy's default linear interpolation);
    ``margin`` (the primer's Figure 5): margins ``m_ij = s_ij + b_j - a_i`` with ``a_i`` the
    (k+1)-th largest biased score of token i, and ``c_j = b_j - M_j`` with ``M_j`` the (q+1)-th
    largest margin of column j, ``q = floor(m k / n)`` (floor when ``m k / n`` is not an integer;
    ``M_j`` = the smallest margin when ``q >= m``), so exactly q margins of column j exceed the
    adjustment when they are distinct; ``sign`` (DeepSeek-V3 baseline):
    ``b += sign_step * sign(mean_load - load)``; ``none``: b. Returns the new bias, centred
    (``c - mean(c)``) for the quantile and margin rules."""
    s, b = f64(scores), f64(bias)
    n = s.shape[1]
    if rule == "none":
        return b.copy()
    biased = s + b
    if rule == "sign":
        idx = np.argsort(-biased, axis=-1, kind="stable")[:, :top_k]
        load = expert_load(idx, n)
        return b + sign_step * np.sign(load.mean() - load)
    if rule == "quantile":
        c = b - np.quantile(biased, 1.0 - top_k / n, axis=0)
    elif rule == "margin":
        kth = np.sort(biased, axis=-1)[:, ::-1][:, min(top_k, n - 1)]       # (k+1)-th largest
        margins = biased - kth[:, None]
        m = s.shape[0]
        q = min(m * top_k // n, m - 1)
        c = b - np.sort(margins, axis=0)[m - 1 - q]                          # (q+1)-th largest
    else:
        raise ValueError(f"unknown QB rule '{rule}' (want quantile, margin, sign or none)")
    return c - c.mean()
