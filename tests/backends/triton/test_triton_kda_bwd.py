"""The chunked Triton backward of ``kda_forward`` (``backends/triton/kda_bwd*.py``, SPEC.md 3)
against float64 autograd through an independent token-by-token recurrence (written in
tests/backends/triton/test_triton_kda.py from SPEC.md 3.3-3.5): every gradient (q, k, v, g raw, beta logit, A_log,
dt_bias, initial state), both gates, odd lengths, variable-length batches, final-state gradients.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` at tiny sizes in fp32 (SPEC.md 11:
1e-5; A_log/dt_bias sum fp32 terms over every token and channel: 5e-5).
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.backends.triton import kda_forward
from k3ir.backends.triton.kda.bwd import kda_backward
from test_triton_kda import DEV, GPU, GRAD_NAMES, make, ref_torch64

TOL = {n: (3e-3 if GPU else (5e-5 if n in ("A_log", "dt_bias") else 1e-5)) for n in GRAD_NAMES}


def _ref(x, w, ws, cu=None):
    """float64 autograd gradients of ``sum(o * w) + sum(S * ws)`` through ``ref_torch64``."""
    leaves = [x[n].double().requires_grad_() if x[n] is not None else None for n in GRAD_NAMES]
    if cu is None:
        o, s = ref_torch64(*leaves[:7], x["lb"], leaves[7])
    else:
        os_, ss = [], []
        for i in range(len(cu) - 1):
            a, b = cu[i], cu[i + 1]
            h = None if leaves[7] is None else leaves[7][i:i + 1]
            if a == b:      # an empty sequence passes its state through
                ss.append(h.double())
                continue
            oi, si = ref_torch64(*(t[:, a:b] for t in leaves[:5]), *leaves[5:7], x["lb"], h)
            os_.append(oi)
            ss.append(si)
        o, s = torch.cat(os_, 1), torch.cat(ss, 0)
    ((o * w.double()).sum() + (s * ws.double()).sum()).backward()
    return {n: (t.grad if t is not None else None) for n, t in zip(GRAD_NAMES, leaves)}


def _autograd(x, w, ws, cu=None):
    """The same gradients through ``kda_forward``'s autograd (forward kernels + backward kernels)."""
    leaves = [x[n].clone().requires_grad_() if x[n] is not None else None for n in GRAD_NAMES]
    o, s = kda_forward(*leaves[:7], lower_bound=x["lb"], initial_state=leaves[7], output_final_state=True,
                       cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    ((o * w.to(o.dtype)).sum() + (s * ws.to(s.dtype)).sum()).backward()
    return {n: (t.grad if t is not None else None) for n, t in zip(GRAD_NAMES, leaves)}


def _direct(x, w, ws, cu=None):
    """The backward kernels alone (``kda_backward``), given do = w and dht = ws."""
    got = kda_backward(*(x[n] for n in GRAD_NAMES), w, ws, x["lb"],
                       cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    return dict(zip(GRAD_NAMES, got))


def _weights(x, cu, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K = x["k"].shape
    N = B if cu is None else len(cu) - 1
    return (torch.randn(B, T, H, x["v"].shape[-1], generator=gen).to(DEV),
            torch.randn(N, H, K, x["v"].shape[-1], generator=gen).to(DEV))


def _check(x, cu=None, seed=0, via=_direct, tol=None):
    w, ws = _weights(x, cu, seed)
    got, want = via(x, w, ws, cu), _ref(x, w, ws, cu)
    for n in GRAD_NAMES:
        if want[n] is None:
            assert got[n] is None, n
            continue
        assert got[n] is not None, n
        assert got[n].dtype == x[n].dtype and got[n].shape == x[n].shape, n
        e = rel_err(got[n], want[n])
        assert e < (tol or TOL)[n], f"{n}: {e:.2e}"


@pytest.mark.parametrize(("T", "lb"), [(1, -5.0), (17, -5.0), (64, -5.0), (65, -5.0), (130, -5.0),
                                       (1, None), (65, None)])
def test_gradients_all_inputs(T, lb):
    B = 2 if lb is not None or T == 1 else 1        # softplus: slow exact loops under the interpreter
    _check(make(B, T, 2, 16, lb=lb, seed=100 + T), seed=T)


@pytest.fixture
def bwd_tuning():
    """Overrides of ``TritonConfig.kda_bwd`` for the test, undone after it."""
    from _triton_config import section_overrides
    with section_overrides("kda_bwd") as over:
        yield over


def test_gradients_k3_dense_diagonal(bwd_tuning):
    """The K3 gate through the centred dense diagonal tiles (kda_bwd.k3_exact "", the fast path; the default takes
    the exact element-wise diagonals since the 01:52 H200 failure of the dense path, covered by the other tests):
    D=128 in K slices, two full chunks plus a tail, saturating gates (per-token decays up to the bound, sub-chunk
    spans near 80, factors near exp(+-40))."""
    bwd_tuning["k3_exact"] = ""
    x = make(1, 130, 1, 128, lb=-5.0, seed=41)
    x["A_log"] = torch.ones_like(x["A_log"])          # exp(1) (g + dt_bias): many gates saturate near -5
    _check(x, seed=42)


def test_gradients_wider_heads_no_initial_state():
    _check(make(1, 65, 2, 32, lb=-5.0, seed=3, h0=False), seed=4)


def test_gradients_softplus_strong_decay():
    """Decays far past exp(-80) inside one 16-row sub-chunk: the exact diagonal paths stay finite.
    dg/dA_log/dt_bias are ill-conditioned here in fp32 (large in-chunk terms cancel in the reverse
    cumsum); the torch recompute's own errors are 1.6e-5 / 1.2e-4 / 1.0e-4 (ours 9e-6 / 6e-5 / 7e-5)."""
    tol = dict(TOL, g=3e-5, A_log=2e-4, dt_bias=2e-4)
    _check(make(1, 40, 2, 16, lb=None, strong=True, seed=5), seed=6, tol=tol)


def test_gradients_softplus_dense_and_exact_diagonals(bwd_tuning):
    """The diagonal tiles of bwd_intra and prep with the softplus gate: dense where a sub-chunk's channels decay by
    at most ``kda_bwd.intra_dense_span`` in log, element-wise elsewhere; a threshold of 50 sends some sub-chunks of
    this input each way (checked on G), then every gradient against the float64 reference."""
    bwd_tuning["intra_dense_span"] = 50.0
    x = make(1, 96, 2, 16, lb=None, seed=31)
    w, ws = _weights(x, None, 32)
    dbg: dict = {}
    kda_backward(*(x[n] for n in GRAD_NAMES), w, ws, None, debug=dbg)
    G = torch.cat([torch.zeros(1, 1, 2, 16, device=DEV), dbg["G"]], 1)     # G before row 0 is 0 in each chunk
    spans = [float((G[0, 0 if r % 64 == 0 else r] - G[0, r + 16]).max()) for r in range(0, 96, 16)]
    assert min(spans) <= 50.0 < max(spans), spans
    _check(x, seed=32)


@pytest.mark.parametrize(("lb", "cu"), [(-5.0, [0, 5, 5, 75, 100]), (None, [0, 5, 5, 70])])
def test_gradients_varlen(lb, cu):
    _check(make(1, cu[-1], 2, 16, N=len(cu) - 1, lb=lb, seed=9), cu=cu, seed=10)


@pytest.mark.parametrize(("split", "lb"), [(True, -5.0), (False, -5.0), (False, None)])
def test_gradients_prep_split_and_single_launch(bwd_tuning, split, lb):
    """The recompute's w, u, qg, kg from the prep_wu launch (``kda_bwd.prep_split``, default) and from inside prep
    (the A/B variant): varlen with an empty sequence, a full chunk and a tail, D=64 in two 32-wide prep slices."""
    bwd_tuning["prep_split"] = split
    cu = [0, 5, 5, 70, 100]
    _check(make(1, cu[-1], 1, 64, N=len(cu) - 1, lb=lb, seed=21), cu=cu, seed=22)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_autograd_through_kda_forward(lb):
    _check(make(1, 70, 2, 16, lb=lb, seed=13), seed=14, via=_autograd)


def test_autograd_varlen_through_kda_forward():
    _check(make(1, 40, 2, 16, N=3, seed=15), cu=[0, 17, 17, 40], seed=16, via=_autograd)


def test_torch_recompute_still_selectable(bwd_tuning):
    x = make(1, 20, 2, 16, seed=11)
    w, ws = _weights(x, None, 12)
    a = _autograd(x, w, ws)
    bwd_tuning["mode"] = "torch"
    b = _autograd(x, w, ws)
    for n in GRAD_NAMES:
        assert rel_err(a[n], b[n]) < (1e-4 if GPU else 1e-5), n


def test_backward_runs_under_the_forward_config(monkeypatch):
    """The backward takes the TritonConfig of its forward (autograd may run it on another thread): a forward inside
    ``triton_config(kda_bwd={"mode": "torch"})`` with ``backward()`` outside it never launches the Triton
    backward (``kda_bwd.kda_backward``), and the reverse launches it once."""
    from k3ir.backends.triton.config import triton_config
    from k3ir.backends.triton.kda import bwd as KB
    calls = []
    real = KB.kda_backward
    monkeypatch.setattr(KB, "kda_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = make(1, 20, 2, 16, seed=12)
    w, _ = _weights(x, None, 13)
    leaves = [x[n].clone().requires_grad_() if x[n] is not None else None for n in GRAD_NAMES]
    for mode, want in (("torch", 0), ("triton", 1)):
        calls.clear()
        with triton_config(kda_bwd={"mode": mode}):
            o, _ = kda_forward(*leaves[:7], lower_bound=x["lb"], initial_state=leaves[7])
        with triton_config(kda_bwd={"mode": "torch" if mode == "triton" else "triton"}):
            (o * w.to(o.dtype)).sum().backward()
        assert len(calls) == want, mode


# ---- the backward reusing the forward's intermediates (TritonConfig.kda.bwd_reuse, default on) -------------------
@pytest.fixture
def fwd_tuning():
    """Overrides of ``TritonConfig.kda`` for the test, undone after it."""
    from _triton_config import section_overrides
    with section_overrides("kda") as over:
        yield over


class _Counter:
    """Stands in for a ``@triton.jit`` kernel and counts its launches."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.fn[grid]


@pytest.mark.parametrize(("lb", "cu", "T"), [(-5.0, None, 70), (-5.0, [0, 5, 5, 75, 100], 100),
                                             (None, [0, 1, 20, 20, 40], 40)])
def test_autograd_reuse_on_and_off(monkeypatch, fwd_tuning, lb, cu, T):
    """``kda_forward``'s autograd with the forward's w, u, qg, kg, P, (I+Akk)^-1, G, qn, kn reused (no prep and
    no prelude launch) and with the recompute (``bwd_reuse`` False, both launched): both against float64
    autograd, and the two within fp32 rounding of each other. Both gates, T not a multiple of 64, varlen with an
    empty and a 1-token sequence, initial state and final-state gradient."""
    from k3ir.backends.triton.kda import bwd_kernels as KBK
    x = make(1, T, 2, 16, N=None if cu is None else len(cu) - 1, lb=lb, seed=50 + T)
    w, ws = _weights(x, cu, 51 + T)
    want = _ref(x, w, ws, cu)
    got = {}
    for reuse in (True, False):
        fwd_tuning["bwd_reuse"] = reuse
        spy, spy_pre = _Counter(KBK.kda_bwd_prep_kernel), _Counter(KBK.kda_bwd_prelude_kernel)
        monkeypatch.setattr(KBK, "kda_bwd_prep_kernel", spy)
        monkeypatch.setattr(KBK, "kda_bwd_prelude_kernel", spy_pre)
        got[reuse] = _autograd(x, w, ws, cu)
        monkeypatch.setattr(KBK, "kda_bwd_prep_kernel", spy.fn)
        monkeypatch.setattr(KBK, "kda_bwd_prelude_kernel", spy_pre.fn)
        assert spy.n == (0 if reuse else 1), f"prep launches with bwd_reuse={reuse}: {spy.n}"
        assert spy_pre.n == (0 if reuse else 1), f"prelude launches with bwd_reuse={reuse}: {spy_pre.n}"
        for n in GRAD_NAMES:
            assert got[reuse][n].dtype == x[n].dtype and got[reuse][n].shape == x[n].shape, n
            e = rel_err(got[reuse][n], want[n])
            assert e < TOL[n], f"bwd_reuse={reuse} {n}: {e:.2e}"
    for n in GRAD_NAMES:
        assert rel_err(got[True][n], got[False][n]) < (1e-3 if GPU else 2e-5), n


@pytest.mark.parametrize(("lb", "cu", "T"), [(-5.0, [0, 5, 5, 75, 100], 100), (None, None, 40)])
def test_saved_intermediates_match_prep(monkeypatch, lb, cu, T):
    """Every buffer the forward hands to the backward (``kda.saved_for_backward``) against the one the
    backward's prep / prelude launches compute (``kda_backward(debug=...)``): same definitions (P with the
    q scale and the diagonal, Ai unscaled with zero upper blocks, kg with the last valid row's G, qn with the q
    scale), on valid rows; the backward given them skips the prep and prelude launches and matches the recompute."""
    from k3ir.backends.triton.kda import bwd_kernels as KBK
    from k3ir.backends.triton.kda import chunk as KF
    x = make(1, T, 2, 16, N=None if cu is None else len(cu) - 1, lb=lb, seed=60 + T)
    w, ws = _weights(x, cu, 61)
    cut = None if cu is None else torch.tensor(cu, device=DEV)
    args = [x[n] for n in GRAD_NAMES[:7]]
    _, _, inter = KF.kda_forward_kernels(*args, lb, x["h0"], True, cut, return_intermediates=True, store_ai=True)
    sv = KF.saved_for_backward(inter)
    assert sv is not None and set(sv) == {"w", "u", "qg", "kg", "P", "Ai", "G", "qn", "kn"}
    dbg: dict = {}
    kda_backward(*args, x["h0"], w, ws, lb, cu_seqlens=cut, debug=dbg)
    for n in ("w", "u", "qg", "kg", "P", "Ai", "G"):
        assert sv[n].dtype == dbg[n].dtype and sv[n].shape == dbg[n].shape, n
        e = rel_err(sv[n], dbg[n])
        assert e < (2e-3 if GPU else 1e-5), f"{n}: {e:.2e}"
    for n in ("qn", "kn"):      # the same normalisation up to fp32 rounding (one product associated differently)
        assert sv[n].dtype == dbg[n].dtype and sv[n].shape == dbg[n].shape, n
        e = rel_err(sv[n], dbg[n])
        assert e < (8e-3 if GPU else 1e-6), f"{n}: {e:.2e}"
    # the saved buffers alone give the recompute's gradients, without the prep and prelude launches
    a = kda_backward(*args, x["h0"], w, ws, lb, cu_seqlens=cut)
    spies = {n: _Counter(getattr(KBK, n)) for n in ("kda_bwd_prep_kernel", "kda_bwd_prelude_kernel")}
    for n, spy in spies.items():
        monkeypatch.setattr(KBK, n, spy)
    dbg2: dict = {}
    b = kda_backward(*args, x["h0"], w, ws, lb, cu_seqlens=cut, saved=sv, debug=dbg2)
    assert {n: spy.n for n, spy in spies.items()} == dict.fromkeys(spies, 0)
    assert rel_err(dbg2["bn"], dbg["bn"]) < 1e-6     # sigmoid(beta) by torch vs the prelude's
    for n, ga, gb in zip(GRAD_NAMES, a, b):
        assert rel_err(gb, ga) < (1e-3 if GPU else 2e-5), n


def test_reuse_falls_back_without_the_inverse(fwd_tuning):
    """With the inverse inside the akk launch (``kda.inv = "akk"``: no unscaled Ai) the forward saves
    nothing extra and the backward recomputes: gradients still right."""
    fwd_tuning["inv"] = "akk"
    x = make(1, 40, 2, 16, lb=-5.0, seed=71)
    from k3ir.backends.triton.kda import chunk as KF
    _, _, inter = KF.kda_forward_kernels(*(x[n] for n in GRAD_NAMES[:7]), -5.0, None, False, None,
                                         return_intermediates=True, store_ai=True)
    assert KF.saved_for_backward(inter) is None
    _check(x, seed=72, via=_autograd)


# ---- GPU: real head size, bf16, fla's gradient tolerance (8e-3) ---------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_gradients_bf16_varlen_with_states(lb):
    cu = [0, 1, 64, 65, 300, 700]
    x = make(1, 700, 2, 128, dtype=torch.bfloat16, N=len(cu) - 1, lb=lb, seed=21)
    w, ws = _weights(x, cu, 22)
    got, want = _direct(x, w.bfloat16(), ws, cu), _ref(x, w, ws, cu)
    for n in GRAD_NAMES:
        e = rel_err(got[n], want[n])
        print(f"gpu bwd grad {n} lb={lb}: {e:.2e}")
        assert e < 8e-3, n


# ---- guard pages: every scratch/output buffer and every input sits inside a NaN-filled block -------------------
def _guard_copy(t, made, pad=512):
    """``t``'s values in the middle of a NaN block (reads past it bring NaN into the gradients)."""
    if t is None:
        return None
    big = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    big[pad:pad + t.numel()] = t.reshape(-1)
    made.append((big, pad, t.numel()))
    return big[pad:pad + t.numel()].view(t.shape)


@pytest.mark.parametrize(("B", "T", "D", "lb", "cu"), [(1, 130, 128, -5.0, [0, 0, 1, 70, 130]), (1, 1000, 32, -5.0, None),
                                                       (1, 100, 16, None, [0, 0, 1, 37, 100])])
def test_no_out_of_bounds_access(monkeypatch, bwd_tuning, B, T, D, lb, cu):
    """Each kernel under the interpreter with buffers allocated exactly to size inside NaN guards: no store
    outside a buffer (the guards stay NaN), no read outside one or of an unwritten element (the gradients stay
    finite and match float64 autograd). Tails: T not a multiple of 64 or 16; varlen with an empty and a
    1-token sequence; D=128 in four K slices."""
    from k3ir.backends.triton.kda import bwd as KB
    if T == 1000:
        bwd_tuning["k3_exact"] = ""         # the long case on the dense K3 tiles (the D=128 case takes the default)
    made: list = []

    def alloc(shape, dtype, device):
        n = 1
        for s in shape:
            n *= int(s)
        return _guard_copy(torch.full((n,), float("nan"), dtype=dtype, device=device), made).view(*shape)
    monkeypatch.setattr(KB, "_alloc", alloc)
    x = make(B, T, 1, D, N=None if cu is None else len(cu) - 1, lb=lb, seed=31)
    w, ws = _weights(x, cu, 32)
    xg = {n: (_guard_copy(v, made) if torch.is_tensor(v) else v) for n, v in x.items()}
    got = KB.kda_backward(*(xg[n] for n in GRAD_NAMES), _guard_copy(w, made), _guard_copy(ws, made), lb,
                          cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
    for big, pad, n in made:
        assert torch.isnan(big[:pad]).all() and torch.isnan(big[pad + n:]).all(), "store outside a buffer"
    want = _ref(x, w, ws, cu)
    for name, g in zip(GRAD_NAMES, got):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, want[name]) < (3e-3 if GPU else 5e-5 if name in ("A_log", "dt_bias") else 2e-5), name
