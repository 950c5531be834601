"""Reference ops against independent values: hand formulas, explicit loops, SPEC.md examples."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import rel_err
from k3ir.backends.reference import ReferenceExecutable

from k3ir.balancing import qb_update
from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.types import StateType, TensorType


# ---- helpers ---------------------------------------------------------------------------
def _type(a) -> TensorType:
    a = np.asarray(a)
    return TensorType("i64" if a.dtype.kind in "iu" else "f64", a.shape)


def run_op(opname: str, *inputs, states: dict[int, StateType] | None = None, **attrs):
    """Build ``f(inputs) = opname(inputs) {attrs}`` and run it on the reference target.
    ``states`` maps an input position to its state type. Returns the result list."""
    states = states or {}
    m = Module("t")
    fn = Function("f")
    b = Builder(m, fn)
    args = [b.arg(f"a{i}", states.get(i) or _type(x)) for i, x in enumerate(inputs)]
    out = b.op(opname, *args, **attrs)
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    m.add_function(fn)
    return ReferenceExecutable(m, "float64", "cpu").run("f", list(inputs), {})


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


# ---- SiTU-GLU / SwiGLU -----------------------------------------------------------------
def test_situ_glu_at_8_is_29_83():
    (y,) = run_op("k3.situ_glu", np.array([8.0]), np.array([8.0]), b1=4.0, b2=25.0)
    hand = 4 * math.tanh(2.0) * (1 / (1 + math.exp(-8.0))) * 25 * math.tanh(0.32)
    assert abs(y[0] - 29.83) < 1e-2
    assert y[0] == pytest.approx(hand, rel=1e-15, abs=0)


def test_situ_glu_is_bounded(rng):
    g, u = rng.uniform(-60, 60, (4, 64)), rng.uniform(-60, 60, (4, 64))
    (y,) = run_op("k3.situ_glu", g, u)
    assert np.all(np.abs(y) < 100.0)
    want = 4 * np.tanh(g / 4) * sig(g) * 25 * np.tanh(u / 25)
    assert rel_err(y, want) < 1e-14
    (y,) = run_op("k3.situ_glu", np.array([1e4, -1e4, 1e4]), np.array([1e4, 1e4, -1e4]))
    assert np.all(np.isfinite(y)) and np.all(np.abs(y) <= 100.0)


def test_swiglu(rng):
    g, u = rng.normal(size=(3, 5, 7)) * 3, rng.normal(size=(3, 5, 7))
    (y,) = run_op("k3.swiglu", g, u)
    assert rel_err(y, g / (1 + np.exp(-g)) * u) < 1e-14


# ---- norms -----------------------------------------------------------------------------
def test_rmsnorm_vs_hand(rng):
    x, w = rng.normal(size=(2, 3, 8)), rng.normal(size=8)
    (y,) = run_op("k3.rmsnorm", x, w, eps=1e-5)
    want = np.empty_like(x)
    for i in range(2):
        for t in range(3):
            ms = sum(v * v for v in x[i, t]) / 8
            want[i, t] = [x[i, t, c] / math.sqrt(ms + 1e-5) * w[c] for c in range(8)]
    assert rel_err(y, want) < 1e-14


def test_l2norm_vs_hand(rng):
    x = rng.normal(size=(2, 4, 3, 6))
    (y,) = run_op("k3.l2norm", x, eps=1e-6)
    want = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        want[idx] = x[idx] / math.sqrt(float(np.dot(x[idx], x[idx])) + 1e-6)
    assert rel_err(y, want) < 1e-14
    assert np.allclose(np.sum(y * y, -1), 1.0, atol=1e-5)


def test_gated_rmsnorm_vs_hand(rng):
    x, gate, w = rng.normal(size=(2, 3, 2, 4)), rng.normal(size=(2, 3, 2, 4)), rng.normal(size=4)
    (y,) = run_op("k3.gated_rmsnorm", x, gate, w, eps=1e-5)
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w * sig(gate)
    assert rel_err(y, want) < 1e-14


# ---- short conv ------------------------------------------------------------------------
def conv_loop(x, w, hist):
    """Explicit causal depthwise conv + SiLU: y[t,c] = silu(sum_j w[c,j] * xx[t+j, c]),
    xx = (history oldest first) ++ x; returns (y, last K-1 inputs as [B,C,K-1])."""
    B, T, C = x.shape
    K = w.shape[2]
    y = np.zeros((B, T, C))
    new = np.zeros((B, C, K - 1))
    for b in range(B):
        for c in range(C):
            seq = list(hist[b, c]) + list(x[b, :, c])
            for t in range(T):
                acc = 0.0
                for j in range(K):
                    acc += w[c, 0, j] * seq[t + j]
                y[b, t, c] = acc / (1 + math.exp(-acc))
            new[b, c] = seq[-(K - 1):]
    return y, new


def test_short_conv_vs_loop_with_state(rng):
    B, C, K = 2, 5, 4
    w = rng.normal(size=(C, 1, K))
    st = StateType("conv_state", (C, K - 1))
    x1, x2 = rng.normal(size=(B, 7, C)), rng.normal(size=(B, 3, C))
    y1, s1 = run_op("k3.short_conv", x1, w)
    want1, ws1 = conv_loop(x1, w, np.zeros((B, C, K - 1)))
    assert rel_err(y1, want1) < 1e-14 and rel_err(s1, ws1) < 1e-14
    y2, s2 = run_op("k3.short_conv", x2, w, s1, states={2: st})
    want2, ws2 = conv_loop(x2, w, ws1)
    assert rel_err(y2, want2) < 1e-14 and rel_err(s2, ws2) < 1e-14
    # continuation: conv over T1 then T2 (carrying the state) == conv over T1+T2
    y12, s12 = run_op("k3.short_conv", np.concatenate([x1, x2], 1), w)
    assert rel_err(np.concatenate([y1, y2], 1), y12) < 1e-14
    assert rel_err(s2, s12) < 1e-14


def test_short_conv_shorter_than_kernel(rng):
    B, C, K = 1, 3, 4
    w, x = rng.normal(size=(C, 1, K)), rng.normal(size=(B, 1, C))
    hist = rng.normal(size=(B, C, K - 1))
    y, s = run_op("k3.short_conv", x, w, hist, states={2: StateType("conv_state", (C, K - 1))})
    want, ws = conv_loop(x, w, hist)
    assert rel_err(y, want) < 1e-14 and rel_err(s, ws) < 1e-14


# ---- KDA gate ----------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["lower_bound", "softplus"])
def test_kda_gate_vs_spec(form, rng):
    B, T, H, D = 2, 3, 3, 4
    z = rng.normal(size=(B, T, H, D)) * 3
    A_log = rng.normal(size=H + 3)                 # longer than H: the first H are used
    dt_bias = rng.normal(size=H * D) * 2           # per channel
    (g,) = run_op("k3.kda_gate", z, A_log, dt_bias, form=form, lower_bound=-5.0)
    want = np.empty_like(z)
    for b, t, h, d in np.ndindex(B, T, H, D):
        a = math.exp(A_log[h])
        x = z[b, t, h, d] + dt_bias[h * D + d]      # channel h*D+d
        if form == "lower_bound":
            want[b, t, h, d] = -5.0 / (1 + math.exp(-a * x))
        else:
            want[b, t, h, d] = -a * math.log1p(math.exp(x))
    assert rel_err(g, want) < 1e-13
    assert np.all(g <= 0)
    if form == "lower_bound":
        assert np.all(g >= -5.0)
    # a per-head reading of dt_bias (or a [D,H] layout) gives a different answer
    wrong = dt_bias.reshape(D, H).T.reshape(-1)
    (g_wrong,) = run_op("k3.kda_gate", z, A_log, wrong, form=form, lower_bound=-5.0)
    assert rel_err(g_wrong, want) > 1e-3


def test_kda_gate_rejects_positive_bound(rng):
    from k3ir.errors import K3VerifyError
    with pytest.raises(K3VerifyError, match="lower_bound"):
        run_op("k3.kda_gate", rng.normal(size=(1, 1, 2, 2)), np.zeros(2), np.zeros(4), form="lower_bound",
               lower_bound=5.0)


# ---- router ------------------------------------------------------------------------------
def logit(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p) - np.log1p(-p)


def test_router_unbiased_weights_biased_selection_ties():
    # x @ I = logit(s), so the sigmoid scores are exactly s
    s = np.array([[[0.5, 0.7, 0.7, 0.2], [0.3, 0.3, 0.3, 0.3]]])          # [1,2,4]
    bias = np.array([0.3, 0.0, 0.0, 0.0])
    w, idx, scores = run_op("k3.router", logit(s), np.eye(4), bias, top_k=2, routed_scaling_factor=2.5)
    assert np.allclose(scores, s, atol=1e-15)
    # token 0: biased (0.8, 0.7, 0.7, 0.2): experts 0 then 1 (tie 1/2 goes to the lower index)
    # token 1: biased (0.6, 0.3, 0.3, 0.3): 0 then 1 (three-way tie)
    assert idx.tolist() == [[[0, 1], [0, 1]]]
    want = np.array([[[0.5 / 1.2 * 2.5, 0.7 / 1.2 * 2.5], [0.3 / 0.6 * 2.5, 0.3 / 0.6 * 2.5]]])
    assert rel_err(w, want) < 1e-14
    # without bias, token 0 picks the tied pair (1, 2)
    w0, idx0, _ = run_op("k3.router", logit(s), np.eye(4), np.zeros(4), top_k=2, routed_scaling_factor=1.0)
    assert idx0[0, 0].tolist() == [1, 2] and idx0[0, 1].tolist() == [0, 1]
    assert rel_err(w0[0, 0], [0.5, 0.5]) < 1e-14


def test_router_random_vs_loop(rng):
    x, W, bias = rng.normal(size=(2, 3, 6)), rng.normal(size=(5, 6)), rng.normal(size=5) * 0.1
    w, idx, _s = run_op("k3.router", x, W, bias, top_k=3, routed_scaling_factor=1.7)
    for b, t in np.ndindex(2, 3):
        sc = [1 / (1 + math.exp(-float(np.dot(W[e], x[b, t])))) for e in range(5)]
        order = sorted(range(5), key=lambda e: (-(sc[e] + bias[e]), e))[:3]
        assert idx[b, t].tolist() == order
        tot = sum(sc[e] for e in order)
        assert rel_err(w[b, t], [sc[e] / tot * 1.7 for e in order]) < 1e-13


# ---- Quantile Balancing ----------------------------------------------------------------------
PRIMER = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])


def test_qb_primer_example():
    b = qb_update(PRIMER, np.zeros(2), top_k=1, rule="quantile")
    # before centring b = (-0.55, -0.45) (minus the column medians); their mean is -0.5
    assert np.allclose(b + (-0.5), [-0.55, -0.45], atol=1e-15)
    assert np.allclose(b, [-0.05, 0.05], atol=1e-15)
    # route with the router op: scores are exactly PRIMER (x @ I = logit(s))
    _, idx, _ = run_op("k3.router", logit(PRIMER)[None], np.eye(2), b, top_k=1)
    load = np.bincount(idx.reshape(-1), minlength=2)
    assert load.tolist() == [2, 2]
    _, idx0, _ = run_op("k3.router", logit(PRIMER)[None], np.eye(2), np.zeros(2), top_k=1)
    assert np.bincount(idx0.reshape(-1), minlength=2).tolist() == [3, 1]     # unbalanced before


def quantile_linear(col, p):
    """Linear-interpolation quantile (NumPy's default), written out."""
    xs = sorted(col)
    pos = p * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


@pytest.mark.parametrize("rule", ["quantile", "margin"])
def test_qb_quantile_rules_vs_formula(rule, rng):
    m, n, k = 37, 6, 2
    s, b = rng.uniform(size=(m, n)), rng.normal(size=n) * 0.05
    got = qb_update(s, b, top_k=k, rule=rule)
    biased = s + b
    c = np.empty(n)
    for j in range(n):
        if rule == "quantile":
            c[j] = b[j] - quantile_linear([biased[i, j] for i in range(m)], 1 - k / n)
        else:
            col = [biased[i, j] - sorted(biased[i], reverse=True)[k] for i in range(m)]   # (k+1)-th largest
            c[j] = b[j] - sorted(col, reverse=True)[m * k // n]        # (q+1)-th largest margin, q = floor(mk/n)
    assert rel_err(got, c - c.mean()) < 1e-13
    assert abs(got.sum()) < 1e-12


def test_qb_sign_rule_vs_formula(rng):
    m, n, k = 40, 5, 2
    s, b = rng.uniform(size=(m, n)), rng.normal(size=n) * 0.01
    got = qb_update(s, b, top_k=k, rule="sign", sign_step=1e-3)
    load = np.zeros(n)
    for i in range(m):
        for e in sorted(range(n), key=lambda e: (-(s[i, e] + b[e]), e))[:k]:
            load[e] += 1
    want = b + 1e-3 * np.sign(load.mean() - load)
    assert rel_err(got, want) < 1e-15
    assert np.array_equal(qb_update(s, b, top_k=k, rule="none"), b)
    with pytest.raises(ValueError):
        qb_update(s, b, top_k=k, rule="bogus")


# ---- MoE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_vs_dense_loop(act, rng):
    B, T, D, I, E, k = 2, 3, 6, 5, 4, 2
    x = rng.normal(size=(B, T, D))
    w1, w3, w2 = rng.normal(size=(E, I, D)), rng.normal(size=(E, I, D)), rng.normal(size=(E, D, I))
    idx = np.stack([rng.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k).astype(np.int64)
    wts = rng.uniform(size=(B, T, k))
    (y,) = run_op("k3.moe", x, wts, idx, w1, w3, w2, act=act, b1=4.0, b2=25.0)
    want = np.zeros_like(x)
    for b, t in np.ndindex(B, T):
        for j in range(k):
            e = idx[b, t, j]
            g, u = w1[e] @ x[b, t], w3[e] @ x[b, t]
            if act == "situ":
                h = 4 * np.tanh(g / 4) * sig(g) * 25 * np.tanh(u / 25)
            else:
                h = g * sig(g) * u
            want[b, t] += wts[b, t, j] * (w2[e] @ h)
    assert rel_err(y, want) < 1e-13


# ---- AttnRes -----------------------------------------------------------------------------------------
def test_attn_res_zero_query_is_mean(rng):
    srcs = [rng.normal(size=(2, 3, 8)) for _ in range(4)]
    (y,) = run_op("k3.attn_res", np.zeros((1, 8)), rng.normal(size=8), *srcs)
    assert rel_err(y, sum(srcs) / 4) < 1e-14


def test_attn_res_vs_hand_softmax(rng):
    d = 8
    srcs = [rng.normal(size=(2, 3, d)) * (i + 1) for i in range(3)]
    w, r = rng.normal(size=(1, d)), rng.normal(size=d)
    (y,) = run_op("k3.attn_res", w, r, *srcs, eps=1e-5)
    want = np.zeros((2, 3, d))
    for b, t in np.ndindex(2, 3):
        sc = []
        for v in srcs:
            vv = v[b, t]
            rms = math.sqrt(sum(a * a for a in vv) / d + 1e-5)
            sc.append(sum(vv[c] / rms * r[c] * w[0, c] for c in range(d)))
        ex = [math.exp(s - max(sc)) for s in sc]
        for a, v in zip(ex, srcs):
            want[b, t] += a / sum(ex) * v[b, t]
    assert rel_err(y, want) < 1e-13


# ---- MLA ---------------------------------------------------------------------------------------------------
H, NOPE, ROPE, VD, R = 2, 128, 64, 128, 16
MLA_ATTRS = {"heads": H, "nope": NOPE, "rope": ROPE, "v_dim": VD, "scale": 1 / math.sqrt(192)}
CACHE = StateType("mla_cache", (R, ROPE))


def mla_inputs(rng, B, T, L=0):
    q = rng.normal(size=(B, T, H, NOPE + ROPE))
    kv = rng.normal(size=(B, T, R + ROPE))
    w = rng.normal(size=(H * (NOPE + VD), R)) / 4
    cache = rng.normal(size=(B, L, R + ROPE)) if L else None
    return q, kv, w, cache


def mla_plain(q, kv, w, cache):
    """Per-head softmax attention with k = [W_uk c_kv | k_rope], v = W_uv c_kv, /sqrt(192)."""
    full = kv if cache is None else np.concatenate([cache, kv], 1)
    B, T = q.shape[:2]
    S = full.shape[1]
    wh = w.reshape(H, NOPE + VD, R)
    o = np.zeros((B, T, H, VD))
    for b, h in np.ndindex(B, H):
        ckv, kr = full[b, :, :R], full[b, :, R:]
        k = np.concatenate([ckv @ wh[h, :NOPE].T, kr], axis=1)             # [S, 192]
        v = ckv @ wh[h, NOPE:].T                                            # [S, VD]
        for t in range(T):
            pos = S - T + t                                                 # absolute position
            sc = np.array([q[b, t, h] @ k[s] / math.sqrt(192) for s in range(pos + 1)])
            a = np.exp(sc - sc.max())
            o[b, t, h] = (a / a.sum()) @ v[: pos + 1]
    return o, full


@pytest.mark.parametrize("L", [0, 5])
def test_mla_absorbed_equals_unabsorbed_and_plain(L, rng):
    q, kv, w, cache = mla_inputs(rng, 2, 4, L)
    args = (q, kv, w) if cache is None else (q, kv, w, cache)
    st = {3: CACHE}
    o_u, c_u = run_op("k3.mla", *args, states=st, absorbed=False, **MLA_ATTRS)
    o_a, c_a = run_op("k3.mla", *args, states=st, absorbed=True, **MLA_ATTRS)
    assert rel_err(o_a, o_u) < 1e-10
    assert np.array_equal(c_a, c_u)
    want, full = mla_plain(q, kv, w, cache)
    assert rel_err(o_u, want) < 1e-12
    assert c_u.shape == (2, L + 4, R + ROPE) and np.array_equal(c_u, full)


def test_mla_causal_prefix_independent_of_later_tokens(rng):
    q, kv, w, _ = mla_inputs(rng, 1, 6)
    o1, _ = run_op("k3.mla", q, kv, w, **MLA_ATTRS)
    q2, kv2 = q.copy(), kv.copy()
    q2[:, 4:] = rng.normal(size=q2[:, 4:].shape)
    kv2[:, 4:] = rng.normal(size=kv2[:, 4:].shape)
    o2, _ = run_op("k3.mla", q2, kv2, w, **MLA_ATTRS)
    assert np.array_equal(o1[:, :4], o2[:, :4])
    assert not np.allclose(o1[:, 4:], o2[:, 4:])


def test_mla_decode_with_cache_equals_full(rng):
    q, kv, w, _ = mla_inputs(rng, 2, 5)
    o_full, _ = run_op("k3.mla", q, kv, w, **MLA_ATTRS)
    o_pre, cache = run_op("k3.mla", q[:, :4], kv[:, :4], w, **MLA_ATTRS)
    o_dec, cache2 = run_op("k3.mla", q[:, 4:], kv[:, 4:], w, cache, states={3: CACHE}, absorbed=True, **MLA_ATTRS)
    assert rel_err(np.concatenate([o_pre, o_dec], 1), o_full) < 1e-12
    assert cache2.shape == (2, 5, R + ROPE)


# ---- small core ops with subtle rules ----------------------------------------------------------------------
def test_topk_ties_lower_index_first():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    v, i = run_op("k3.topk", x, k=3)
    assert i.tolist() == [[1, 2, 4]] and v.tolist() == [[3.0, 3.0, 3.0]]


def test_embedding_and_lm_head(rng):
    table, ids = rng.normal(size=(11, 4)), np.array([[3, 0, 10]], dtype=np.int64)
    (e,) = run_op("k3.embedding", ids, table)
    assert np.array_equal(e[0], table[[3, 0, 10]])
    x, W = rng.normal(size=(1, 2, 4)), rng.normal(size=(11, 4))
    (lg,) = run_op("k3.lm_head", x, W)
    assert rel_err(lg, np.einsum("btd,vd->btv", x, W)) < 1e-14
