"""Triton kernel entry points refuse, before launching, what would write outside a buffer or corrupt results:
out-of-range, repeated or missing state slots, per-head instead of per-channel ``dt_bias``, a short ``A_log``,
a non-negative gate bound (``kda_decode``); an unknown gate form, non-integer ``cu_seqlens``, a gate bound the
chunked kernels overflow on (``kda_forward``); expert ids, group offsets and combine rows outside their
tensors (MoE); cache lengths and positions past the cache (MLA). Each raises ``K3KernelInputError`` naming
the argument, and the buffers the launch would have written stay untouched.

The kernels run under ``TRITON_INTERPRET=1`` on the CPU (tiny sizes), where every index tensor lives on the
host, so the value checks run without a device sync.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.backends.triton import kda_decode, kda_forward
from k3ir.backends.triton.mla import attn as mla_k
from k3ir.backends.triton.moe import grouped as moe_k
from k3ir.backends.triton.moe.dispatch import moe_dispatch

from k3ir.errors import K3KernelInputError, K3RuntimeError
from k3ir.ops.kda import kda_gate_ref, kda_recurrent

DEV = "cuda" if torch.cuda.is_available() else "cpu"
P, H, K = 3, 2, 16


def _decode_args(B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    return {"q": r(B, H * K), "k": r(B, H * K), "v": r(B, H * K), "z": r(B, H * K), "beta": r(B, H),
            "A_log": r(H) * 0.5, "dt_bias": r(H * K), "pool": r(P, H, K, K),
            "slots": torch.tensor([2, 0], dtype=torch.int32, device=DEV)[:B]}


def _decode(a, **kw):
    args = {**a, **kw}
    return kda_decode(args["q"], args["k"], args["v"], args["z"], args["beta"], args["A_log"], args["dt_bias"],
                      args["pool"], args["slots"], lower_bound=args.get("lower_bound", -5.0))


def test_decode_valid_slots_match_recurrence():
    """The checks pass a valid call through unchanged: rows 0, 1 update slots 2, 0 as the float64 step."""
    a = _decode_args()
    pool0 = a["pool"].clone()
    o = _decode(a)
    n = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    f = lambda t: t.double().cpu().numpy().reshape(2, 1, H, K)
    gl = kda_gate_ref(f(a["z"]), a["A_log"].cpu().numpy(), a["dt_bias"].cpu().numpy(), "lower_bound", -5.0)
    beta = 1 / (1 + np.exp(-a["beta"].double().cpu().numpy()[:, None]))
    o_r, s_r = kda_recurrent(n(f(a["q"])), n(f(a["k"])), f(a["v"]), gl, beta, K ** -0.5,
                             pool0.double().cpu().numpy()[[2, 0]])
    assert rel_err(o, o_r.reshape(2, H * K)) < 1e-5
    assert rel_err(a["pool"][[2, 0]], s_r) < 1e-6
    assert torch.equal(a["pool"][1], pool0[1])


@pytest.mark.parametrize("slots, match", [
    ([0, 3], r"slots\[1\] = 3 is out of range, expected 0 <= slots < 3"),
    ([-1, 0], r"slots\[0\] = -1 is out of range"),
    ([1, 1], "slots holds 1 2 times, expected distinct"),
    ([0], r"slots has shape \[1\], expected \[2\]"),
], ids=["out_of_range", "negative", "repeated", "too_few"])
def test_decode_refuses_bad_slots(slots, match):
    """An out-of-range slot wrote outside the pool (the process segfaulted); a repeated one raced two rows on
    one state; too few slots read past the slot list. Now: an error naming the slot, the pool untouched."""
    a = _decode_args()
    pool0 = a["pool"].clone()
    with pytest.raises(K3KernelInputError, match=match):
        _decode(a, slots=torch.tensor(slots, dtype=torch.int32, device=DEV))
    assert torch.equal(a["pool"], pool0)


def test_decode_refuses_float_slots_and_more_rows_than_slots():
    a = _decode_args()
    with pytest.raises(K3KernelInputError, match="slots has dtype torch.float32"):
        _decode(a, slots=torch.tensor([2.0, 0.0], device=DEV))
    b = _decode_args(B=2)
    b["pool"] = b["pool"][:1].contiguous()
    with pytest.raises(K3KernelInputError, match="2 rows need 2 distinct slots but the pool"):
        _decode(b, slots=torch.tensor([0, 0], dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("arg, value, match", [
    ("dt_bias", lambda a: a["dt_bias"][:H], r"dt_bias has 2 elements \(shape \[2\]\), expected 32"),
    ("A_log", lambda a: a["A_log"][:1], r"A_log has 1 elements \(shape \[1\]\), expected at least 2"),
    ("lower_bound", lambda a: 1.0, r"lower_bound=1.0 must be negative"),
    ("lower_bound", lambda a: 0.0, r"lower_bound=0.0 must be negative"),
    ("z", lambda a: a["z"][:, :K], r"z has shape \[2, 16\], expected \[2, 32\]"),
], ids=["dt_bias_per_head", "A_log_short", "lower_bound_positive", "lower_bound_zero", "z_short"])
def test_decode_refuses_bad_gate_parameters(arg, value, match):
    """dt_bias per head instead of per channel (SPEC.md 10) read past its end; a short A_log likewise; a
    positive bound makes g > 0 (the state grows without bound)."""
    a = _decode_args()
    pool0 = a["pool"].clone()
    with pytest.raises(K3KernelInputError, match=match):
        _decode(a, **{arg: value(a)})
    assert torch.equal(a["pool"], pool0)


def _fwd_args(T=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    return [r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H), r(H), r(H * K)]


def test_forward_refuses_unknown_gate_form():
    with pytest.raises(K3KernelInputError, match=r"gate='softpuls' is unknown, expected one of 'raw', 'precomputed'"):
        kda_forward(*_fwd_args(), gate="softpuls")


def test_forward_refuses_float_cu_seqlens():
    """A float cu_seqlens was truncated to other sequence boundaries (5.5 -> 5) without a word."""
    with pytest.raises(K3KernelInputError, match="cu_seqlens has dtype torch.float32"):
        kda_forward(*_fwd_args(), cu_seqlens=torch.tensor([0.0, 5.5, 8.0], device=DEV))


def test_forward_refuses_lower_bound_past_minus_five():
    """The chunked kernels factor decays for |g| <= 5 (exp(+-80) in fp32): a bound of -10 gave NaN outputs."""
    with pytest.raises(K3KernelInputError, match=r"lower_bound=-10.0 must lie in \[-5.0, 0\)"):
        kda_forward(*_fwd_args(), lower_bound=-10.0)
    with pytest.raises(K3RuntimeError, match="lower_bound"):
        kda_forward(*_fwd_args(), lower_bound=0.0)


def _moe_inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, 16, generator=g).to(DEV)
    w = torch.rand(1, 3, 2, generator=g).to(DEV)
    return x, w


def test_moe_dispatch_refuses_expert_ids_out_of_range():
    x, w = _moe_inputs()
    idx = torch.tensor([[[0, 1], [2, 4], [3, 1]]], device=DEV)
    with pytest.raises(K3KernelInputError, match=r"moe_dispatch: idx\[3\] = 4 is out of range, expected 0 <= idx < 4"):
        moe_dispatch(x, w, idx, 4)
    with pytest.raises(ValueError, match="idx has dtype torch.float32"):     # also a ValueError, as documented
        moe_dispatch(x, w, idx.float(), 4)


def test_grouped_matmul_refuses_offsets_past_the_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g).to(DEV)
    w = torch.randn(2, 16, 32, generator=g).to(DEV)
    with pytest.raises(K3KernelInputError, match=r"offsets = \[0, 4, 9\] must rise from 0 to at most the 6 rows"):
        moe_k.grouped_matmul(x, torch.tensor([0, 4, 9], device=DEV), w)
    with pytest.raises(K3KernelInputError, match=r"offsets = \[0, 4, 3\]"):
        moe_k.grouped_matmul(x, torch.tensor([0, 4, 3], device=DEV), w)
    with pytest.raises(K3KernelInputError, match="offsets has dtype torch.float32"):
        moe_k.grouped_matmul(x, torch.tensor([0.0, 4.0, 6.0], device=DEV), w)


def test_moe_combine_refuses_rows_outside_y():
    y = torch.randn(6, 16, device=DEV)
    inv = torch.tensor([[[0, 1], [2, 6], [4, 5]]], device=DEV)
    with pytest.raises(K3KernelInputError, match=r"moe_combine: inv\[3\] = 6 is out of range, expected 0 <= inv < 6"):
        moe_k.moe_combine(y, None, inv)


def _mla_decode_inputs(B=1, Hh=2, R=16, Pr=16, cap=8, seed=4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)
    return r(B, Hh, R), r(B, Hh, Pr), r(B, cap, R + Pr)


def test_mla_decode_refuses_length_past_the_cache():
    qt, qr, cache = _mla_decode_inputs()
    ok = mla_k.mla_decode(qt, qr, cache, torch.tensor([8], dtype=torch.int32, device=DEV), 0.1)
    assert torch.isfinite(ok).all()
    with pytest.raises(K3KernelInputError, match=r"nlen\[0\] = 9 is out of range, expected 0 <= nlen < 9"):
        mla_k.mla_decode(qt, qr, cache, torch.tensor([9], dtype=torch.int32, device=DEV), 0.1)
    with pytest.raises(K3KernelInputError, match=r"lengths\[0\] = 12 is out of range"):
        mla_k.mla_decode(qt, qr, cache, torch.tensor([8], dtype=torch.int32, device=DEV), 0.1,
                         lengths=torch.tensor([12], device=DEV))


def test_mla_decode_absorbed_refuses_write_past_the_cache():
    """pos is the cache row the step writes: pos = Lcap wrote one row past the buffer."""
    Hh, n, r, vd, R = 2, 16, 16, 16, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, Hh, n + r, generator=g).to(DEV)
    kv = torch.randn(1, 1, R + r, generator=g).to(DEV)
    w = torch.randn(Hh * (n + vd), R, generator=g).to(DEV)
    cache = torch.zeros(1, 8, R + r, device=DEV)
    with pytest.raises(K3KernelInputError, match=r"pos\[0\] = 8 is out of range, expected 0 <= pos < 8"):
        mla_k.mla_decode_absorbed(q, kv, w, cache, torch.tensor([8], device=DEV),
                                  torch.tensor([8], dtype=torch.int32, device=DEV), Hh, n, vd, 0.1)
    assert not cache.any()


def test_mla_prefill_refuses_lengths_past_the_keys():
    g = torch.Generator().manual_seed(6)
    B, T, Hh, n, r, vd = 1, 4, 2, 16, 16, 16
    q = torch.randn(B, T, Hh, n + r, generator=g).to(DEV)
    kn = torch.randn(B, T, Hh, n, generator=g).to(DEV)
    kr = torch.randn(B, T, r, generator=g).to(DEV)
    v = torch.randn(B, T, Hh, vd, generator=g).to(DEV)
    with pytest.raises(K3KernelInputError, match=r"lengths\[0\] = 5 is out of range, expected 0 <= lengths < 5"):
        mla_k.mla_prefill(q, kn, kr, v, 0.1, lengths=torch.tensor([5], device=DEV))
