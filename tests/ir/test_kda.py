"""KDA (SPEC.md 3): token-by-token recurrence vs the chunked form, state continuation, a hand
case, the op's reference, and the torch backend's chunked/recurrent paths."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

from k3ir.ops.kda import kda_chunked, kda_gate_ref, kda_recurrent

TS = [1, 63, 64, 65, 130]
B, H, K, V = 2, 2, 8, 6


def kda_inputs(rng, T, gate, B=B, H=H, K=K, V=V):
    """L2-normalised q, k; v; log-decay g from the model's gate forms; beta in (0,1).
    ``lower_bound``: g in [-5, 0]; ``softplus``: unbounded, with some large |g|."""
    q = rng.normal(size=(B, T, H, K))
    k = rng.normal(size=(B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V))
    z = rng.normal(size=(B, T, H, K)) * 2
    A_log = rng.normal(size=H)
    dt = rng.normal(size=H * K)
    if gate == "lower_bound":
        g = kda_gate_ref(z, A_log, dt, "lower_bound", -5.0)
        assert g.min() >= -5.0 and g.max() <= 0
    else:
        z[..., 0, :] += rng.uniform(0, 30, size=z[..., 0, :].shape)     # some very large |g|
        g = kda_gate_ref(z, np.log(rng.uniform(1, 16, size=H)), dt, "softplus")
        assert g.min() < -20
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    return q, k, v, g, beta


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, gate, with_state, rng):
    q, k, v, g, beta = kda_inputs(rng, T, gate)
    S0 = rng.normal(size=(B, H, K, V)) if with_state else None
    scale = K ** -0.5
    o_r, s_r = kda_recurrent(q, k, v, g, beta, scale, S0)
    for C in (16, 64):
        o_c, s_c = kda_chunked(q, k, v, g, beta, scale, S0, chunk_size=C)
        assert rel_err(o_c, o_r) < 1e-10, C
        assert rel_err(s_c, s_r) < 1e-10, C


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_state_continuation(gate, rng):
    q, k, v, g, beta = kda_inputs(rng, 70, gate)
    scale = K ** -0.5
    o, s = kda_recurrent(q, k, v, g, beta, scale)
    o1, s1 = kda_chunked(q[:, :33], k[:, :33], v[:, :33], g[:, :33], beta[:, :33], scale, chunk_size=16)
    o2, s2 = kda_chunked(q[:, 33:], k[:, 33:], v[:, 33:], g[:, 33:], beta[:, 33:], scale, s1, chunk_size=64)
    assert rel_err(np.concatenate([o1, o2], 1), o) < 1e-10
    assert rel_err(s2, s) < 1e-10
    o3, s3 = kda_recurrent(q[:, 33:], k[:, 33:], v[:, 33:], g[:, 33:], beta[:, 33:], scale,
                           kda_recurrent(q[:, :33], k[:, :33], v[:, :33], g[:, :33], beta[:, :33], scale)[1])
    assert rel_err(o3, o[:, 33:]) < 1e-12 and rel_err(s3, s) < 1e-12


def test_one_token_by_hand(rng):
    """S0 = 0: S1 = beta k v^T, so o = scale * beta * <q, k> * v (the gate has nothing to decay)."""
    q, k, v = rng.normal(size=(1, 1, 1, 4)), rng.normal(size=(1, 1, 1, 4)), rng.normal(size=(1, 1, 1, 3))
    g = np.full((1, 1, 1, 4), -0.7)
    beta = np.array([[[0.3]]])
    scale = 0.5
    o, S = kda_recurrent(q, k, v, g, beta, scale)
    want = scale * 0.3 * float(q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0]
    assert rel_err(o[0, 0, 0], want) < 1e-14
    assert rel_err(S[0, 0], 0.3 * np.outer(k[0, 0, 0], v[0, 0, 0])) < 1e-14
    # second token by hand: S = exp(g) S; u = S^T k; S += beta k (v - u)^T; o = scale S^T q
    q2, k2, v2 = rng.normal(size=4), rng.normal(size=4), rng.normal(size=3)
    g2, b2 = rng.uniform(-2, 0, size=4), 0.8
    S1 = np.exp(g2)[:, None] * S[0, 0]
    S2 = S1 + b2 * np.outer(k2, v2 - S1.T @ k2)
    o2, _ = kda_recurrent(q2[None, None, None], k2[None, None, None], v2[None, None, None],
                          g2[None, None, None], np.array([[[b2]]]), scale, S)
    assert rel_err(o2[0, 0, 0], scale * S2.T @ q2) < 1e-14


def test_zero_gate_allowed(rng):
    q, k, v, _, beta = kda_inputs(rng, 20, "lower_bound")
    g = np.zeros_like(q)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.3)
    o_c, s_c = kda_chunked(q, k, v, g, beta, 0.3, chunk_size=16)
    assert rel_err(o_c, o_r) < 1e-10 and rel_err(s_c, s_r) < 1e-10


def test_kda_op_reference_equals_recurrent(rng):
    from test_ops import run_op

    from k3ir.types import StateType
    q, k, v, g, beta = kda_inputs(rng, 9, "lower_bound")
    S0 = rng.normal(size=(B, H, K, V))
    o, s = run_op("k3.kda", q, k, v, g, beta, scale=0.25)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.25)
    assert rel_err(o, o_r) < 1e-14 and rel_err(s, s_r) < 1e-14
    o, s = run_op("k3.kda", q, k, v, g, beta, S0, states={5: StateType("kda_state", (H, K, V))}, scale=0.25)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.25, S0)
    assert rel_err(o, o_r) < 1e-14 and rel_err(s, s_r) < 1e-14


# ---- torch backend (fp32) vs the float64 reference --------------------------------------------------
torch = pytest.importorskip("torch")
torch.set_num_threads(1)          # tiny shapes: extra threads only contend on a busy machine


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_torch_kda_paths_vs_reference(T, gate, rng):
    from k3ir.backends.torch import ops as tops
    q, k, v, g, beta = kda_inputs(rng, T, gate)
    S0 = rng.normal(size=(B, H, K, V))
    scale = K ** -0.5
    o_r, s_r = kda_recurrent(q, k, v, g, beta, scale, S0)
    tq, tk, tv, tg, tb, ts = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v, g, beta, S0))
    o_c, s_c = tops.kda_chunked(tq, tk, tv, tg, tb, scale, ts, chunk=64)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5
    o_c16, _ = tops.kda_chunked(tq, tk, tv, tg, tb, scale, ts, chunk=16)
    assert rel_err(o_c16, o_r) < 1e-5
    if T <= 65:
        o_t, s_t = tops.kda_recurrent(tq, tk, tv, tg, tb, scale, ts)
        assert rel_err(o_t, o_r) < 1e-5 and rel_err(s_t, s_r) < 1e-5
    # the op's dispatch (recurrent for T <= 2, chunked otherwise), without a state
    inst = type("Inst", (), {"scale": scale, "chunk_size": 64})()
    o_op, s_op = tops.kda(inst, tq, tk, tv, tg, tb)
    o_r0, s_r0 = kda_recurrent(q, k, v, g, beta, scale)
    assert rel_err(o_op, o_r0) < 1e-5 and rel_err(s_op, s_r0) < 1e-5
    assert o_op.dtype == torch.float32 and s_op.dtype == torch.float32


def test_torch_kda_zero_gate(rng):
    from k3ir.backends.torch import ops as tops
    q, k, v, _, beta = kda_inputs(rng, 40, "lower_bound")
    g = np.zeros_like(q)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, 0.3)
    o_c, s_c = tops.kda_chunked(*(torch.tensor(a, dtype=torch.float32) for a in (q, k, v, g, beta)), 0.3)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5
