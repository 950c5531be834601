"""Long prompts in linear memory on the triton target (CPU: ``TRITON_INTERPRET=1``, float32, tiny sizes): the MLA
prefill over key tiles (mla_tiled.py) equals the one-launch kernel and the float64 reference, its allocations
grow by the latent cache row per extra key (the untiled path adds the up-projected keys and values), and
``Session.prefill`` in segments over it equals one prefill, its peak allocations growing by the logits row and
twice the state row per extra token (slow)."""
from __future__ import annotations

import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from _tiny_models import KIMI_LINEAR_TINY
from conftest import rel_err
from helpers import AllocationPeak
from k3ir.backends.triton import lowering
from k3ir.backends.triton.config import triton_config
from k3ir.backends.triton.mla import tiled as mt
from k3ir.runtime import Session

import k3ir
from k3ir.errors import K3KernelInputError
from k3ir.ops.mla import mla_ref

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter sizes")

H, NOPE, ROPE, VD, R = 2, 16, 8, 16, 32
INST = types.SimpleNamespace(heads=H, nope=NOPE, rope=ROPE, v_dim=VD, scale=0.3, absorbed=False)
#: a Kimi Linear of 2 layers (KDA, then MLA): the smallest model with both, a few seconds a segment here
TWO_LAYERS = dict(KIMI_LINEAR_TINY, **{"num_hidden_layers": 2, "linear_attn_config.full_attn_layers": [2],
                                      "linear_attn_config.kda_layers": [1],
                                      "layer_types": ["linear_attention", "full_attention"],
                                      "mlp_layer_types": ["dense", "sparse"]})


def _operands(B, T, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(B, T, H, NOPE + ROPE, generator=g), torch.randn(B, T, R + ROPE, generator=g)
    w = torch.randn(H * (NOPE + VD), R, generator=g) * 0.3
    c = torch.randn(B, L, R + ROPE, generator=g) if L else None
    return q, kv, w, c


def test_tiled_prefill_equals_one_launch_and_reference():
    """Tiles of 16 keys over a 50-row right-padded cache + 70 new tokens (rows with 50, 0, 17 valid entries),
    and without a cache: the one-launch kernel within 1e-6, the float64 reference ``mla_ref`` within SPEC.md
    11's 1e-5; the full cache returned is the one-launch path's."""
    base = lowering.make_mla(types.SimpleNamespace())
    q, kv, w, c = _operands(3, 70, 50)
    lens = torch.tensor([50, 0, 17])
    for cache, lengths in ((c, lens), (None, None)):
        want, full = base(INST, q, kv, w, cache, lengths)
        got, full_t = mt.mla_tiled_prefill(INST, q, kv, w, cache, lengths, tile=16)
        assert got.dtype == q.dtype and torch.equal(full_t, full)
        assert rel_err(got, want) < 1e-6
        ref, _ = mla_ref(*(t.double().numpy() if t is not None else None for t in (q, kv, w, cache)),
                         lengths=None if lengths is None else lengths.numpy(), heads=H, nope=NOPE, rope=ROPE,
                         v_dim=VD, scale=0.3, absorbed=False)
        assert rel_err(got, ref) < 1e-5


def test_tiled_prefill_refuses_lengths_past_the_cache():
    q, kv, w, c = _operands(1, 8, 4)
    with pytest.raises(K3KernelInputError, match="lengths"):
        mt.mla_tiled_prefill(INST, q, kv, w, c, torch.tensor([5]), tile=4)


def test_key_tiles_bound_the_allocations_per_extra_key():
    """Peak torch allocations of one 32-token prefill over caches of 96, 224 and 480 rows: with tiles of 32 keys
    each extra key costs exactly one float32 latent cache row ((R + rope) x 4 bytes, the concatenated cache the op
    returns), the same in both steps; the one-launch path also holds every key's up-projected key and value
    (H x (nope + v_dim) more numbers per key)."""
    base = lowering.make_mla(types.SimpleNamespace())
    tiled, plain = {}, {}
    for L in (96, 224, 480):
        q, kv, w, c = _operands(1, 32, L, seed=L)
        with AllocationPeak() as a:
            mt.mla_tiled_prefill(INST, q, kv, w, c, None, tile=32)
        tiled[L] = a.peak
        with AllocationPeak() as a:
            base(INST, q, kv, w, c, None)
        plain[L] = a.peak
    row = (R + ROPE) * 4
    assert (tiled[224] - tiled[96]) / 128 == (tiled[480] - tiled[224]) / 256 == row
    assert (plain[480] - plain[224]) / 256 >= row + H * (NOPE + VD) * 4


def test_long_prefill_hook_takes_the_tiles_past_the_config_tile(monkeypatch):
    """The executable's ``k3.mla`` goes through the tiles only past ``TritonConfig.mla.prefill_key_tile`` keys
    and only for prefills (more than one new token)."""
    calls = []
    monkeypatch.setattr(mt, "mla_tiled_prefill", lambda *a, **k: calls.append(a[1].shape[1]) or ("tiled", None))
    hook = mt.long_prefill(lambda *a: ("base", None))
    q, kv, w, c = _operands(1, 8, 40)
    with triton_config(mla={"prefill_key_tile": 32}):
        assert hook(INST, q, kv, w, c)[0] == "tiled"
        assert hook(INST, q, kv, w, None)[0] == "base"                         # 8 keys
        assert hook(INST, q[:, :1], kv[:, :1], w, c)[0] == "base"              # one new token: decode
    assert hook(INST, q, kv, w, c)[0] == "base"                                # default tile: 4096 keys
    assert calls == [8]


@pytest.fixture(scope="module")
def two_layers():
    torch.set_num_threads(1)
    m = k3ir.load("kimi-linear-6p6b", TWO_LAYERS)
    return k3ir.compile(m, target="triton", dtype="float32", device="cpu")


def test_segmented_prefill_over_key_tiles_equals_one_prefill(two_layers, monkeypatch):
    """A 2-layer Kimi Linear (KDA + MLA), 128 tokens: one prefill (one MLA launch over all keys) against segments
    of 64 tokens, state carried, whose MLA runs over tiles of 32 keys; logits and every state within SPEC.md 11's
    1e-5 (float32)."""
    ids = np.random.default_rng(0).integers(0, 256, (1, 128))
    one, s1 = Session(two_layers, seed=0, prefill_chunk=4096).prefill(ids)
    calls = []
    real = mt.mla_tiled_prefill
    monkeypatch.setattr(mt, "mla_tiled_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    with triton_config(mla={"prefill_key_tile": 32}):
        seg, s2 = Session(two_layers, seed=0, prefill_chunk=64).prefill(ids)
    assert len(calls) == 2 and seg.shape == one.shape and s2.length == s1.length == 128
    assert rel_err(seg, one) < 1e-5
    for name in s1.names:
        assert rel_err(torch.as_tensor(s2.values[name]), torch.as_tensor(s1.values[name])) < 1e-5, name


@pytest.mark.slow
def test_segmented_prefill_allocations_grow_by_a_constant_number_of_bytes_per_token(two_layers):
    """Peak torch allocations of ``Session.prefill`` (segments of 64, MLA over 32-key tiles) at 128, 192 and 256
    tokens: the same growth per extra token in both steps, and exactly what must grow: the float32 logits row
    plus twice the state per token (the old state is held while a segment computes the new one): 1520 bytes.
    ~40 s under the interpreter on a shared 2-core CPU."""
    peak, state_bytes = {}, {}
    with triton_config(mla={"prefill_key_tile": 32}):
        for T in (128, 192, 256):
            ids = np.random.default_rng(T).integers(0, 256, (1, T))
            with AllocationPeak() as a:
                logits, state = Session(two_layers, seed=0, prefill_chunk=64).prefill(ids)
            peak[T] = a.peak
            state_bytes[T] = sum(torch.as_tensor(v).nbytes for v in state.values.values())
    step1, step2 = (peak[192] - peak[128]) / 64, (peak[256] - peak[192]) / 64
    must = logits.shape[-1] * 4 + 2 * (state_bytes[256] - state_bytes[128]) / 128
    assert step1 == step2 == must
