"""Long prompts in linear memory on the torch target: ``k3.mla`` over key tiles (online softmax) equals the
one-matrix softmax, ``Session.prefill`` in segments equals one prefill, the engine's prompt limit."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import rel_err
from helpers import AllocationPeak
from k3ir.backends.torch import mla_tiled as tiled
from k3ir.backends.torch import ops
from k3ir.runtime import Session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.sampler import SamplingParams

import k3ir
from k3ir.errors import K3RuntimeError
from k3ir.ops.mla import mla_ref


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def exe(tiny):
    return k3ir.compile(tiny, target="torch", dtype="float32")


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_tiled_mla_equals_one_matrix_softmax(absorbed, dtype, tol, monkeypatch):
    """Tiles of 16 keys over a 50-entry right-padded cache + 70 new tokens (rows with 50, 0, 17 valid
    entries), against the untiled lowering and the float64 reference ``mla_ref``."""
    g = torch.Generator().manual_seed(1)
    H, n, r, vd, R, B, T, L = 2, 4, 3, 5, 6, 3, 70, 50
    inst = types.SimpleNamespace(heads=H, nope=n, rope=r, v_dim=vd, scale=0.3, absorbed=absorbed)
    q, kv = torch.randn(B, T, H, n + r, generator=g), torch.randn(B, T, R + r, generator=g)
    w, c = torch.randn(H * (n + vd), R, generator=g), torch.randn(B, L, R + r, generator=g)
    lens = torch.tensor([50, 0, 17])
    monkeypatch.setattr(tiled, "TILED_ABOVE", 10 ** 9)
    want, full = ops.mla(inst, *(t.to(dtype) for t in (q, kv, w, c)), lens)
    got, full_t = tiled.mla_tiled(inst, *(t.to(dtype) for t in (q, kv, w, c)), lens, tile=16)
    assert got.dtype == dtype and torch.equal(full_t, full)
    assert rel_err(got, want) < tol
    ref, _ = mla_ref(*(t.double().numpy() for t in (q, kv, w, c)), lengths=lens.numpy(), heads=H, nope=n, rope=r,
                     v_dim=vd, scale=0.3, absorbed=absorbed)
    assert rel_err(got, ref) < (1e-12 if dtype == torch.float64 else 1e-6)
    monkeypatch.setattr(tiled, "TILED_ABOVE", 64)             # the hook: ops.mla takes the tiled path
    monkeypatch.setattr(tiled, "KEY_TILE", 16)
    hooked, _ = ops.mla(inst, *(t.to(dtype) for t in (q, kv, w, c)), lens)
    assert torch.equal(hooked, got)


def test_segmented_prefill_equals_one_prefill(exe, monkeypatch):
    """k3-tiny, 300 tokens: one prefill with the untiled MLA against 64-token segments (state carried) whose
    MLA runs over 32-key tiles; logits and every state within 1e-6 (float32)."""
    ids = np.random.default_rng(0).integers(0, 256, (1, 300))
    monkeypatch.setattr(tiled, "TILED_ABOVE", 10 ** 9)
    one, s1 = Session(exe, seed=0, prefill_chunk=4096).prefill(ids)
    monkeypatch.setattr(tiled, "TILED_ABOVE", 64)
    monkeypatch.setattr(tiled, "KEY_TILE", 32)
    calls = []
    real = tiled.mla_tiled
    monkeypatch.setattr(tiled, "mla_tiled", lambda *a, **k: calls.append(1) or real(*a, **k))
    seg, s2 = Session(exe, seed=0, prefill_chunk=64).prefill(ids)
    assert calls and seg.shape == one.shape == (1, 300, one.shape[-1]) and s2.length == s1.length == 300
    assert rel_err(seg, one) < 1e-6
    for name in s1.names:
        assert rel_err(torch.as_tensor(s2.values[name]), torch.as_tensor(s1.values[name])) < 1e-6, name
    with pytest.raises(K3RuntimeError, match="prefill_chunk"):
        Session(exe, seed=0, prefill_chunk=100)


def test_engine_long_prompt_equals_one_prefill_and_prompt_limit(tiny, exe, monkeypatch):
    """The engine prefills a prompt of 5 blocks in block segments over the tiled MLA: its last logits equal
    one prefill; the default prompt limit is the pool's capacity, or max_position_embeddings when lower."""
    ids = np.random.default_rng(1).integers(0, 256, 320).tolist()
    monkeypatch.setattr(tiled, "TILED_ABOVE", 10 ** 9)
    want, _ = Session(exe, seed=0).prefill(np.array([ids]))
    monkeypatch.setattr(tiled, "TILED_ABOVE", 100)
    eng = build_engine(tiny, seed=0, block_size=64, num_blocks=6)
    (req,) = eng.generate([ids], SamplingParams(max_tokens=1), keep_logits=True)
    assert rel_err(req.logits[0], want[0, -1]) < 1e-6
    assert eng.prompt_limit() == 6 * 64 - 1
    raw = eng.session.module.config.raw
    monkeypatch.setitem(raw, "max_position_embeddings", 200)
    assert eng.prompt_limit() == 200
    monkeypatch.setitem(raw, "max_position_embeddings", 10 ** 6)
    assert eng.prompt_limit() == 6 * 64 - 1


def test_prefill_allocations_grow_by_a_constant_number_of_bytes_per_token(exe, monkeypatch):
    """Linear memory, per token: the peak torch allocations of ``Session.prefill`` (segments of 128 tokens, MLA
    over 64-key tiles) at 256, 512 and 768 tokens grow by the same number of bytes per extra token in both steps
    (a quadratic term would double the second step), and that number is what must grow: the float32 logits row
    plus twice the state per token (the old state is held while a segment computes the new one); the score
    matrix of an untiled MLA would add ``heads x segment x 4`` bytes per key."""
    monkeypatch.setattr(tiled, "TILED_ABOVE", 128)
    monkeypatch.setattr(tiled, "KEY_TILE", 64)
    peak, state_bytes = {}, {}
    for T in (256, 512, 768):
        ids = np.random.default_rng(T).integers(0, 256, (1, T))
        with AllocationPeak() as a:
            logits, state = Session(exe, seed=0, prefill_chunk=128).prefill(ids)
        peak[T] = a.peak
        state_bytes[T] = sum(torch.as_tensor(v).nbytes for v in state.values.values())
    step1, step2 = (peak[512] - peak[256]) / 256, (peak[768] - peak[512]) / 256
    state_per_token = (state_bytes[768] - state_bytes[256]) / 512
    must = logits.shape[-1] * 4 + 2 * state_per_token
    assert step2 == pytest.approx(step1, rel=0.02)
    assert step1 <= 1.02 * must, (step1, must)
