"""The triton target's KDA kernels (SPEC.md 3) against independent float64 references.

On a CPU machine the kernels run under ``TRITON_INTERPRET=1`` at tiny sizes (fp32, SPEC.md 11:
1e-5); tests marked ``gpu`` run bf16 at real sizes with fla's tolerances (5e-3 outputs, 8e-3
gradients). References: ``kda_recurrent``/``kda_gate_ref`` (NumPy float64) and, for gradients,
autograd through a float64 token-by-token PyTorch recurrence written here from SPEC.md 3.5.
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
from k3ir.backends.triton import kda_decode, kda_forward, short_conv
from k3ir.backends.triton.kda.layer import gated_rmsnorm

from k3ir.errors import K3RuntimeError
from k3ir.ops.kda import kda_gate_ref, kda_recurrent

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def make(B, T, H, K, V=None, seed=0, dtype=torch.float32, lb=-5.0, strong=False, h0=True, N=None):
    g = torch.Generator().manual_seed(seed)
    V = V or K

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(DEV)
    x = {"q": r(B, T, H, K).to(dtype), "k": r(B, T, H, K).to(dtype), "v": r(B, T, H, V).to(dtype),
             "g": r(B, T, H, K).to(dtype), "beta": r(B, T, H).to(dtype), "A_log": r(H, scale=0.5),
             "dt_bias": r(H * K)}
    if strong:   # softplus gate with decays far past exp(-80) inside one sub-chunk
        x["A_log"] = torch.full((H,), 2.5, device=DEV)
        x["dt_bias"] = x["dt_bias"] * 3 + 6
    x["h0"] = r(N or B, H, K, V) if h0 else None
    x["lb"] = lb
    return x


def ref_np(x, cu=None):
    """float64 NumPy reference: SPEC 3.3 (L2 norm, scale), 3.4 (gate), sigmoid beta, 3.5."""
    f = {k: (v.detach().double().cpu().numpy() if torch.is_tensor(v) else v) for k, v in x.items()}
    K = f["k"].shape[-1]
    n = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    gl = kda_gate_ref(f["g"], f["A_log"], f["dt_bias"], "softplus" if f["lb"] is None else "lower_bound",
                      f["lb"] if f["lb"] is not None else -5.0)
    b = 1 / (1 + np.exp(-f["beta"]))
    if cu is None:
        return kda_recurrent(n(f["q"]), n(f["k"]), f["v"], gl, b, K ** -0.5, f["h0"])
    os_, ss = [], []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        h = None if f["h0"] is None else f["h0"][i:i + 1]
        o, S = kda_recurrent(n(f["q"][:, s:e]), n(f["k"][:, s:e]), f["v"][:, s:e], gl[:, s:e], b[:, s:e], K ** -0.5, h)
        os_.append(o)
        ss.append(S)
    return np.concatenate(os_, axis=1), np.concatenate(ss, axis=0)


def ref_torch64(q, k, v, g, beta, A_log, dt_bias, lb, h0):
    """Differentiable float64 token-by-token KDA (SPEC.md 3.3-3.5), for gradient checks."""
    q, k, v, g, beta, A_log, dt_bias = (t.double() for t in (q, k, v, g, beta, A_log, dt_bias))
    B, T, H, K = k.shape
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a = torch.exp(A_log)[:, None]
    xg = g + dt_bias.reshape(H, K)
    gl = lb * torch.sigmoid(a * xg) if lb is not None else -a * torch.nn.functional.softplus(xg)
    b = torch.sigmoid(beta)
    S = h0.double() if h0 is not None else q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * torch.exp(gl[:, t])[..., None]
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - u) * b[:, t, :, None])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("lb", [-5.0, None])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 13]])
def test_torch_reference64_equals_numpy_reference(lb, cu):
    """The float64 torch reference used at GPU sizes (``kda_reference64``) against the NumPy one (SPEC.md 3.3-3.5),
    with an initial state, variable lengths and an empty sequence."""
    from k3ir.backends.torch.ops import kda_reference64
    x = make(1 if cu else 2, 13, 2, 16, lb=lb, seed=3, h0=True, N=3 if cu else None)
    o, S = kda_reference64(*(x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), lower_bound=lb,
                           initial_state=x["h0"], cu_seqlens=cu)
    o_r, s_r = ref_np(x, cu)
    assert o.dtype == torch.float64 and tuple(o.shape) == o_r.shape and tuple(S.shape) == s_r.shape
    assert np.abs(o.cpu().numpy() - o_r).max() < 1e-12 and np.abs(S.cpu().numpy() - s_r).max() < 1e-12


def run(x, **kw):
    return kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], lower_bound=x["lb"],
                       initial_state=x["h0"], output_final_state=True, **kw)


# ---- CPU interpreter (and GPU) at tiny sizes, fp32 --------------------------------------
@pytest.mark.parametrize("T", [1, 65, 130])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_forward_equals_recurrence(T, lb):
    x = make(2, T, 2, 16, lb=lb, seed=T)
    o, s = run(x)
    o_r, s_r = ref_np(x)
    tol = 1e-5 if not GPU else 3e-3     # tf32 dots on the GPU
    assert rel_err(o, o_r) < tol and rel_err(s, s_r) < tol


def test_unbounded_softplus_gate_stays_finite():
    x = make(1, 40, 2, 16, lb=None, strong=True, h0=False)
    o, s = run(x)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_r, _s_r = ref_np(x)
    assert rel_err(o, o_r) < (1e-5 if not GPU else 3e-3)


def test_varlen_isolates_states():
    cu = [0, 5, 5, 75, 100]
    x = make(1, 100, 2, 16, N=4, seed=3)
    o, s = run(x, cu_seqlens=torch.tensor(cu, device=DEV))
    o_r, s_r = ref_np(x, cu)
    tol = 1e-5 if not GPU else 3e-3
    assert rel_err(o, o_r) < tol and rel_err(s, s_r) < tol
    assert torch.equal(s[1], x["h0"][1])          # the empty sequence keeps its state


@pytest.fixture
def tuning():
    """Overrides of ``TritonConfig.kda`` for the test, undone after it."""
    from _triton_config import section_overrides
    with section_overrides("kda") as over:
        yield over


def _mixed_strong(x, K):
    """Softplus gates whose sub-chunk decay passes exp(-160) on the first half of the channels only:
    the split kernel takes the exact diagonal path on some K slices and the dense dot on others."""
    x["A_log"] = torch.full_like(x["A_log"], 2.5)
    db = x["dt_bias"].reshape(-1, K)
    db[:, : K // 2] = db[:, : K // 2] * 3 + 6
    db[:, K // 2:] = db[:, K // 2:] - 4
    return x


@pytest.mark.parametrize("variant", [
    {"bk": 16, "exact_bk": 16, "wu_bk": 16, "wu_bv": 16},
    {"bk": 32, "exact_bk": 32, "inv_dots": False, "xb": "io"},
    {"bk": 16, "exact_bk": 16, "diag_main": True},
    {"bk": 16, "exact_bk": 16, "gcum": False},
    {"inv": "akk", "inv_warps": 4},
    {"gcum_mode": "rows", "gcum_rows_bk": 16, "gcum_rows_rb": 32, "fast_log": True, "wu_prefetch": True,
     "wu_bk": 16, "wu_bv": 16},
    {"order": "k", "bk": 16, "warps": 4, "wu_mode": "flat", "wu_bk": 16, "wu_bv": 16},
    {"order": "k", "bk": 16, "gcum": False, "gcum_bk": 16},
    {"intra": "fused"},
    {"sp_clamp": True, "clamp_bk": 16},
])
@pytest.mark.parametrize("case", ["k3", "softplus", "mixed"])
def test_forward_variants_k_slices(variant, case, tuning):
    """K = 32 in 16-column slices (several slices per program), T = 70 (neither a multiple of 16 nor 64),
    every TritonConfig.kda variant and gate path (mixed: exact and dense diagonal slices in one block)."""
    tuning.update(variant)
    K = 32
    x = make(1, 70, 2, K, lb=-5.0 if case == "k3" else None, seed=21)
    if case == "mixed":
        _mixed_strong(x, K)
    o, s = run(x)
    o_r, s_r = ref_np(x)
    tol = 1e-5 if not GPU else 3e-3
    assert torch.isfinite(o).all() and rel_err(o, o_r) < tol and rel_err(s, s_r) < tol


def _mid_spans(x, K):
    """Softplus gates with 16-row decay spans of ~80-117 per channel: past the plain reference's exp(80), inside
    the clamped reference's threshold (``kda.sp_clamp``, clamp_thr 120)."""
    x["A_log"] = torch.zeros_like(x["A_log"])
    x["dt_bias"] = x["dt_bias"] * 0.3 + 6.0
    return x


@pytest.mark.parametrize("case", ["mid", "mixed", "varlen", "k64"])
def test_softplus_clamp_variant(case, tuning):
    """``sp_clamp``: the softplus diagonal blocks in the strip dots around ``min(Gs, Ge + 80)`` and, for channels
    whose span passes ``clamp_thr``, their strips exactly from ``kda_diagfix_kernel`` (mixed: spans ~1000 on half
    the channels); 16-column slices (several per program; k64: 32-column slices, two per program in both
    launches), T not a multiple of 16, varlen with an empty sequence."""
    tuning.update({"sp_clamp": True, "clamp_bk": 32 if case == "k64" else 16})
    K = 64 if case == "k64" else 32
    cu = [0, 1, 18, 18, 83] if case == "varlen" else None
    x = make(1, 83 if cu else 70, 2, K, lb=None, seed=21, N=4 if cu else None)
    x = _mid_spans(x, K) if case == "mid" else _mixed_strong(x, K)
    o, s = run(x, cu_seqlens=torch.tensor(cu, device=DEV)) if cu else run(x)
    o_r, s_r = ref_np(x, cu)
    tol = 1e-5 if not GPU else 3e-3
    assert torch.isfinite(o).all() and rel_err(o, o_r) < tol and rel_err(s, s_r) < tol


def test_varlen_softplus_exact_path():
    cu = [0, 1, 18, 18, 83]
    x = _mixed_strong(make(1, 83, 2, 32, lb=None, N=4, seed=23), 32)
    o, s = run(x, cu_seqlens=torch.tensor(cu, device=DEV))
    o_r, s_r = ref_np(x, cu)
    tol = 1e-5 if not GPU else 3e-3
    assert rel_err(o, o_r) < tol and rel_err(s, s_r) < tol
    assert torch.equal(s[2], x["h0"][2])


def test_precomputed_gate_forward():
    """``gate="precomputed"``: g is the log-decay, beta after the sigmoid, q and k used as given."""
    x = make(1, 37, 2, 32, seed=29, h0=True)
    gl = -torch.nn.functional.softplus(x["g"]) * 0.5
    b = torch.sigmoid(x["beta"])
    o, s = kda_forward(x["q"], x["k"], x["v"], gl, b, None, None, initial_state=x["h0"], output_final_state=True,
                       gate="precomputed", scale=0.25)
    f = lambda t: t.double().cpu().numpy()
    o_r, s_r = kda_recurrent(f(x["q"]), f(x["k"]), f(x["v"]), f(gl), f(b), 0.25, f(x["h0"]))
    tol = 1e-5 if not GPU else 3e-3
    assert rel_err(o, o_r) < tol and rel_err(s, s_r) < tol


@pytest.mark.parametrize("lb", [-5.0, None])
def test_forward_intermediates(lb):
    """The intermediates of one chunk with zero initial state: ``u = Xb V``, ``o = P u``,
    ``gC = exp(sum of the log-decays)``, ``rk = 1/|k|``, against float64 from the inputs."""
    from k3ir.backends.triton.kda.chunk import kda_forward_kernels
    x = make(1, 50, 2, 16, lb=lb, seed=31, h0=False)
    _o, _, it = kda_forward_kernels(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                    lower_bound=lb, return_intermediates=True)
    o_r, _ = ref_np(x)
    Xb = torch.tril(it["Xb"][0].permute(1, 0, 2)[:, :, :50].double())      # [H, T, T]
    u = Xb @ x["v"][0].permute(1, 0, 2).double()
    P = it["Aqk"][0].permute(1, 0, 2)[:, :, :50].double()
    tol = 1e-5 if not GPU else 3e-3
    assert rel_err(u.permute(1, 0, 2)[None], it["u"]) < tol
    assert rel_err((P @ u).permute(1, 0, 2)[None], o_r) < tol
    f = {k: v.double().cpu().numpy() for k, v in x.items() if torch.is_tensor(v)}
    gl = kda_gate_ref(f["g"], f["A_log"], f["dt_bias"], "softplus" if lb is None else "lower_bound", -5.0)
    assert rel_err(it["gC"][0], np.exp(gl[0].sum(0))) < tol
    assert rel_err(it["rk"], 1 / np.sqrt((f["k"] ** 2).sum(-1) + 1e-6)) < tol
    Gl = np.cumsum(gl[0], 0)              # T = 50: one chunk, so G is the cumsum over all rows
    assert rel_err(it["G"][0], Gl) < tol                     # kda_gcum_kernel (kda.gcum, default)


def test_recur_block_rule():
    """``kda.recur_block``: BV (and stages) of the recurrence from waves (hand-computed: 132 SMs, V = 128;
    waves = ceil(V / BV * nh / (132 * ctas)), times the table's step cost; default table: BV 32 cost 1, BV 64 1.22,
    3 stages, 1 CTA per SM)."""
    from k3ir.backends.triton.kda.chunk import recur_block
    assert recur_block(96, 128, 132, "waves") == (64, 3)       # 384 programs = 3 waves vs 192 = 2 (2.44 < 3)
    assert recur_block(32, 128, 132, "waves") == (32, 3)       # 128 vs 64 programs: 1 wave each
    assert recur_block(64, 128, 132, "waves") == (64, 3)       # 256 = 2 waves vs 128 = 1
    assert recur_block(256, 128, 132, "waves") == (64, 3)      # 8 vs 4 waves
    occ = ((32, 3, 1, 1.0), (64, 3, 1, 1.22), (32, 1, 3, 1.8), (64, 1, 2, 2.0))
    assert recur_block(96, 128, 132, "waves", occ) == (32, 1)  # 384 programs in 396 slots: 1 wave x 1.8
    assert recur_block(32, 128, 132, "waves", occ) == (32, 3)  # 1 wave either way: the cheaper step
    assert recur_block(264, 128, 132, "waves", ((32, 3, 1, 1.0), (64, 3, 1, 2.1))) == (32, 3)   # 8 vs 4 x 2.1
    assert recur_block(96, 128, 132) == (32, None) and recur_block(128, 128, 132) == (64, None)   # "nh128"
    assert recur_block(96, 32, 132, "waves") == (32, None) and recur_block(300, 16, 132) == (16, None)  # V < 64
    with pytest.raises(ValueError, match="bv_rule"):
        recur_block(96, 128, 132, "fast")


@pytest.mark.parametrize("variant", [{"bv": 16}, {"bv": 64, "recur_stages": 1}, {"bv_rule": "waves"},
                                     {"bv_rule": "waves", "recur_table": ((64, 1, 2, 2.0),)}])
def test_forward_value_blocks(variant, tuning, monkeypatch):
    """The recurrence split into 8, 2 or (``bv_rule`` "waves" on 2 SMs: 2 waves at BV 64 vs 4 at BV 32) 2 value
    blocks of V = 128, T = 70, initial state: o and the final state against float64."""
    from k3ir.backends.triton.kda import chunk as kd
    monkeypatch.setattr(kd, "_sm_count", lambda dev: 2)
    assert kd.recur_block(2, 128, 2, "waves") == (64, 3)
    tuning.update(variant)
    x = make(1, 70, 2, 16, V=128, seed=41)
    o, s = run(x)
    o_r, s_r = ref_np(x)
    tol = 1e-5 if not GPU else 3e-3
    assert rel_err(o, o_r) < tol and rel_err(s, s_r) < tol


def test_prefix_outputs_and_gradients_ignore_later_tokens():
    x = make(1, 50, 2, 16, seed=5, h0=False)
    y = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in x.items()}
    for name in ("q", "k", "v", "g"):
        y[name][:, 37:] = torch.randn_like(y[name][:, 37:])
    y["beta"][:, 37:] += 3.0
    outs, grads = [], []
    for z in (x, y):
        leaves = {n: z[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        o, _ = kda_forward(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), z["A_log"], z["dt_bias"],
                           lower_bound=z["lb"])
        o[:, :37].square().sum().backward()
        outs.append(o[:, :37].detach())
        grads.append(leaves["k"].grad[:, :37])
    assert torch.equal(outs[0], outs[1])
    assert rel_err(grads[0], grads[1]) < 1e-6


GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def _kernel_and_reference_grads(x, lb, w, ws=None):
    """Gradients of ``sum(o * w) + sum(S * ws)`` (``ws=None``: ``sum(S)``) w.r.t. every input,
    through ``kda_forward`` and through the float64 torch reference: (kernel grads, reference grads)."""
    grads = []
    for fn in ("kernel", "ref"):
        leaves = [x[n].clone().requires_grad_() for n in GRAD_NAMES]
        if fn == "kernel":
            o, s = kda_forward(*leaves[:7], lower_bound=lb, initial_state=leaves[7], output_final_state=True)
        else:
            o, s = ref_torch64(*leaves[:7], lb, leaves[7])
        state_term = s.sum() if ws is None else (s * ws.to(s.dtype)).sum()
        ((o * w.to(o.dtype)).sum() + state_term).backward()
        grads.append([t.grad for t in leaves])
    return grads


@pytest.mark.parametrize("lb", [-5.0, None])
def test_gradients_match_float64_autograd(lb):
    x = make(1, 40, 2, 16, lb=lb, seed=7)
    w = torch.randn(1, 40, 2, 16, device=DEV)
    ws = torch.randn(1, 2, 16, 16, device=DEV)
    got, want = _kernel_and_reference_grads(x, lb, w, ws)
    for n, a, b in zip(GRAD_NAMES, got, want):
        # A_log/dt_bias gradients sum fp32 terms over every token and channel: 5e-5
        tol = 3e-3 if GPU else (5e-5 if n in ("A_log", "dt_bias") else 1e-5)
        assert rel_err(a, b) < tol, n


def test_gradients_softplus_clamp(tuning):
    """The backward reuses the forward's P, (I+A)^-1, w, u, qg, kg: with ``sp_clamp`` (strong gates on half the
    channels: the exact branch too) the gradients still match float64 autograd."""
    tuning.update({"sp_clamp": True, "clamp_bk": 16})
    x = _mixed_strong(make(1, 40, 2, 32, lb=None, seed=9), 32)
    w = torch.randn(1, 40, 2, 32, device=DEV)
    got, want = _kernel_and_reference_grads(x, None, w)
    for n, a, b in zip(GRAD_NAMES, got, want):
        tol = 3e-3 if GPU else (5e-5 if n in ("A_log", "dt_bias") else 1e-5)
        assert rel_err(a, b) < tol, n


def test_bad_inputs_raise():
    x = make(1, 8, 2, 16)
    with pytest.raises(K3RuntimeError, match="dt_bias"):
        kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"][:5])
    with pytest.raises(K3RuntimeError, match="lower_bound"):
        kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], lower_bound=1.0)
    with pytest.raises(K3RuntimeError, match="initial_state"):
        kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                    initial_state=torch.zeros(2, 2, 16, 16, device=DEV))


def _conv_ref(xs, w, s):
    """float64 causal conv + SiLU: xs [B,T,C], w [C,W], s [B,C,W-1] -> (y, new state)."""
    W = w.shape[1]
    full = np.concatenate([s, np.swapaxes(xs, 1, 2)], axis=2)            # [B,C,W-1+T]
    T = xs.shape[1]
    y = np.stack([(full[:, :, t:t + W] * w[None]).sum(-1) for t in range(T)], axis=1)
    return y / (1 + np.exp(-y)), full[:, :, T:]


@pytest.mark.parametrize("T", [1, 2, 37])
def test_short_conv_kernel(T):
    B, C, W = 2, 80, 4
    xs, w, s = torch.randn(B, T, C, device=DEV), torch.randn(C, 1, W, device=DEV), torch.randn(B, C, W - 1, device=DEV)
    y, sn = short_conv(xs, w, s)
    y_r, s_r = _conv_ref(xs.double().cpu().numpy(), w[:, 0].double().cpu().numpy(), s.double().cpu().numpy())
    assert rel_err(y, y_r) < 1e-6 and rel_err(sn, s_r) < 1e-7
    y0, _ = short_conv(xs, w, None)
    y0_r, _ = _conv_ref(xs.double().cpu().numpy(), w[:, 0].double().cpu().numpy(), np.zeros((B, C, W - 1)))
    assert rel_err(y0, y0_r) < 1e-6


def test_gated_rmsnorm_kernel():
    x, gz, w = torch.randn(3, 5, 2, 32, device=DEV), torch.randn(3, 5, 2, 32, device=DEV), torch.randn(32, device=DEV)
    xd, gd, wd = (t.double().cpu().numpy() for t in (x, gz, w))
    want = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-5) * wd / (1 + np.exp(-gd))
    assert rel_err(gated_rmsnorm(x, gz, w, 1e-5), want) < 1e-6


@pytest.mark.parametrize("lb", [-5.0, None])
def test_decode_step_on_pool_slots(lb):
    _check_decode_step(5, 3, 2, 16, 4, lb, [4, 0, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_decode_step_real_size(lb):
    """K = V = 128 with 8 warps: a channel is held by several warps, so the conv-state shift in
    the fused decode step must not race (it did before the barrier: whole-model decode 0.34 rel)."""
    _check_decode_step(70, 64, 32, 128, 4, lb, list(range(69, 5, -1)))


def _check_decode_step(P, B, H, K, W, lb, slot_list):
    C = H * K
    slots = torch.tensor(slot_list, dtype=torch.int32, device=DEV)
    pool = torch.randn(P, H, K, K, device=DEV)
    cpools = [torch.randn(P, C, W - 1, device=DEV) for _ in range(3)]
    cw = [torch.randn(C, 1, W, device=DEV) for _ in range(3)]
    xq, xk, xv, z, gz = (torch.randn(B, C, device=DEV) for _ in range(5))
    beta, A_log, dt, nw = torch.randn(B, H, device=DEV), torch.randn(H, device=DEV), torch.randn(C, device=DEV), \
        torch.randn(K, device=DEV)
    pool0, cp0 = pool.clone(), [c.clone() for c in cpools]
    o = kda_decode(xq, xk, xv, z, beta, A_log, dt, pool, slots, lower_bound=lb,
                   conv=(*cw, *cpools), norm=(nw, gz, 1e-5))
    sl = slots.long().cpu().numpy()
    ys, news = [], []
    for xi, w, c in zip((xq, xk, xv), cw, cp0):
        y, sn = _conv_ref(xi.double().cpu().numpy()[:, None], w[:, 0].double().cpu().numpy(),
                          c.double().cpu().numpy()[sl])
        ys.append(y.reshape(B, 1, H, K))
        news.append(sn)
    nrm = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    gl = kda_gate_ref(z.double().cpu().numpy().reshape(B, 1, H, K), A_log.cpu().numpy(), dt.cpu().numpy(),
                      "softplus" if lb is None else "lower_bound", lb or -5.0)
    o_r, s_r = kda_recurrent(nrm(ys[0]), nrm(ys[1]), ys[2], gl, 1 / (1 + np.exp(-beta.double().cpu().numpy()[:, None])),
                             K ** -0.5, pool0.double().cpu().numpy()[sl])
    o_r = o_r / np.sqrt((o_r ** 2).mean(-1, keepdims=True) + 1e-5) * nw.double().cpu().numpy()
    o_r = o_r / (1 + np.exp(-gz.double().cpu().numpy().reshape(B, 1, H, K)))
    assert rel_err(o, o_r.reshape(B, C)) < 1e-5
    assert rel_err(pool[slots.long()], s_r) < 1e-6
    for c, n in zip(cpools, news):
        assert rel_err(c[slots.long()], n) < 1e-7
    untouched = sorted(set(range(P)) - set(slot_list))
    assert torch.equal(pool[untouched], pool0[untouched])
    assert all(torch.equal(c[untouched], c0[untouched]) for c, c0 in zip(cpools, cp0))


def test_backend_registered_and_says_why_not(monkeypatch):
    from k3ir.backends import get_backend
    be = get_backend("triton")
    assert "k3.fused_kda" in be.lowers() and "k3.kda" in be.lowers()
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "TRITON_INTERPRET" in be.available()
    else:
        assert be.available() is None


# ---- GPU: real sizes, bf16, fla's tolerances --------------------------------------------
def _ref_torch_gpu(x, cu=None):
    """float64 on the GPU, token by token (the torch backend's ``kda_reference64``), for big sizes."""
    from k3ir.backends.torch.ops import kda_reference64
    return kda_reference64(*(x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), lower_bound=x["lb"],
                           initial_state=x["h0"], cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 65, 1000])
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_forward_bf16(T, lb):
    x = make(2, T, 4, 128, dtype=torch.bfloat16, lb=lb, seed=T)
    o, s = run(x)
    o_r, s_r = _ref_torch_gpu(x)
    eo, es = rel_err(o, o_r), rel_err(s, s_r)
    print(f"gpu fwd T={T} lb={lb}: o {eo:.2e} state {es:.2e}")
    assert eo < 5e-3 and es < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_forward_bf16_every_length_below_64(lb):
    """SPEC section 10: odd lengths, every T in 1..63 (a partial first chunk and sub-chunk), bf16 at fla's 5e-3."""
    for T in range(1, 64):
        x = make(1, T, 2, 128, dtype=torch.bfloat16, lb=lb, seed=100 + T)
        o, s = run(x)
        o_r, s_r = _ref_torch_gpu(x)
        assert rel_err(o, o_r) < 5e-3 and rel_err(s, s_r) < 5e-3, T


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_forward_bf16_drift_at_4096(lb):
    """SPEC section 10 drift: at T = 4096 (64 chunks of state carried in fp32) the last 512 outputs and the final
    state stay within fla's 5e-3 of the float64 recurrence, like the whole output."""
    x = make(1, 4096, 4, 128, dtype=torch.bfloat16, lb=lb, seed=31)
    o, s = run(x)
    o_r, s_r = _ref_torch_gpu(x)
    errs = rel_err(o, o_r), rel_err(o[:, -512:], o_r[:, -512:]), rel_err(s, s_r)
    print(f"gpu drift T=4096 lb={lb}: o {errs[0]:.2e}, last 512 {errs[1]:.2e}, state {errs[2]:.2e}")
    assert max(errs) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_decode_drift_bf16_256_steps(lb):
    """SPEC section 10 (prefill-then-decode equals one longer prefill), in bf16 over 256 decode steps: a 256-token
    chunked prefill, then 256 ``kda_decode`` steps carrying the fp32 state in a pool slot; the decode outputs and
    the final state against the float64 recurrence over all 512 tokens, within fla's 5e-3."""
    T0, n, H, K = 256, 256, 4, 128
    x = make(1, T0 + n, H, K, dtype=torch.bfloat16, lb=lb, seed=29)
    o_r, s_r = _ref_torch_gpu(x)
    pre = {k: (v[:, :T0] if k in ("q", "k", "v", "g", "beta") else v) for k, v in x.items()}
    _, s = run(pre)
    pool = s.float().contiguous()
    slots = torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = []
    for t in range(T0, T0 + n):
        q, k, v, z = (x[m][:, t].reshape(1, -1) for m in ("q", "k", "v", "g"))
        o = kda_decode(q, k, v, z, x["beta"][:, t], x["A_log"], x["dt_bias"], pool, slots, lower_bound=lb)
        outs.append(o.reshape(1, 1, H, K))
    o_d = torch.cat(outs, 1)
    eo, es = rel_err(o_d, o_r[:, T0:]), rel_err(pool, s_r)
    print(f"gpu decode drift 256 steps lb={lb}: o {eo:.2e} state {es:.2e}")
    assert eo < 5e-3 and es < 5e-3


@pytest.mark.gpu
def test_gpu_varlen_bf16():
    cu = [0, 1, 64, 65, 1100, 2048]
    x = make(1, 2048, 4, 128, dtype=torch.bfloat16, N=5, seed=11)
    o, s = run(x, cu_seqlens=torch.tensor(cu, device=DEV))
    o_r, s_r = _ref_torch_gpu(x, cu)
    assert rel_err(o, o_r) < 5e-3 and rel_err(s, s_r) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_gradients_bf16(lb):
    x = make(1, 300, 2, 128, dtype=torch.bfloat16, lb=lb, seed=13)
    w = torch.randn(1, 300, 2, 128, device=DEV)
    for n, a, b in zip(GRAD_NAMES, *_kernel_and_reference_grads(x, lb, w)):
        e = rel_err(a, b)
        print(f"gpu grad {n} lb={lb}: {e:.2e}")
        assert e < 8e-3, n


_WGMMA_CHILD = """
import json, sys, torch
sys.path[:0] = sys.argv[1:3]
import test_triton_kda as t
from conftest import rel_err
from k3ir.backends.triton.config import triton_config
lb = None if sys.argv[3] == "None" else float(sys.argv[3])
x = t.make(1, 1000, 4, 128, dtype=torch.bfloat16, lb=lb, seed=37)
w = torch.randn(1, 1000, 4, 128, device=t.DEV)
with triton_config(kda_bwd={"mma_v2": ""}):
    got, want = t._kernel_and_reference_grads(x, lb, w)
torch.cuda.synchronize()
print(json.dumps({n: rel_err(a, b) for n, a, b in zip(t.GRAD_NAMES, got, want)}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("lb", [-5.0, None])
def test_gpu_bwd_wy_with_hopper_wgmma(lb):
    """``TritonConfig.kda_bwd.mma_v2 = ""``: bwd_wy compiled with Hopper wgmma (no ``DISABLE_MMA_V3``), the form
    whose illegal-address fault made ``"bwd_wy"`` the default. In a child process (a fault kills the CUDA context):
    it must run, and every gradient at (1, 1000, 4, 128) bf16 stay within fla's 8e-3 of float64 autograd."""
    import json
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(os.path.dirname(here))
    p = subprocess.run([sys.executable, "-c", _WGMMA_CHILD, here, tests, str(lb)], capture_output=True, text=True,
                       timeout=600, check=False, env={k: v for k, v in os.environ.items() if k != "DISABLE_MMA_V3"})
    assert p.returncode == 0, p.stderr[-2000:]
    errs = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"gpu grads with wgmma in bwd_wy lb={lb}: {errs}")
    assert all(e < 8e-3 for e in errs.values()), errs


@pytest.mark.gpu
def test_gpu_prefix_invariance_bf16():
    x = make(1, 3000, 4, 128, dtype=torch.bfloat16, seed=17, h0=False)
    o1, _ = run(x)
    for n in ("q", "k", "v", "g"):
        x[n][:, 2001:] = torch.randn_like(x[n][:, 2001:])
    o2, _ = run(x)
    assert torch.equal(o1[:, :2001], o2[:, :2001])


def test_k3_tiny_forward_through_triton_target_matches_torch():
    """The pipeline's k3.fused_kda lowered to the kernels (conv, chunked KDA, norm) equals the
    torch target on a whole small model."""
    from k3ir.runtime.session import Session

    import k3ir
    m = k3ir.load("k3-tiny")
    ex_t = k3ir.compile(m, target="triton", dtype="float32", device=DEV)
    ex_r = k3ir.compile(m, target="torch", dtype="float32", device=DEV)
    assert any(op.name == "k3.fused_kda" for f in ex_t.module.functions.values() for op in f.ops)
    ids = np.random.default_rng(0).integers(0, m.attrs["vocab_size"], size=(1, 20))
    a, b = Session(ex_t).forward(ids), Session(ex_r).forward(ids)
    assert rel_err(ex_t.to_numpy(a), ex_r.to_numpy(b)) < (1e-4 if not GPU else 3e-3)


def test_k3_tiny_gate_bound_past_the_kernels_runs_on_torch_kernels():
    """A config's K3 gate bound of -8 overflows the chunked kernels' exp(+-80) factors (NaN outputs before);
    kda_forward refuses it and the triton target's k3.fused_kda prefill takes the torch implementation, so the
    model still equals the torch target."""
    from k3ir.runtime.session import Session

    import k3ir
    m = k3ir.load("k3-tiny", overrides={"linear_attn_config.gate_lower_bound": -8.0})
    ex_t = k3ir.compile(m, target="triton", dtype="float32", device=DEV)
    ex_r = k3ir.compile(m, target="torch", dtype="float32", device=DEV)
    ids = np.random.default_rng(1).integers(0, m.attrs["vocab_size"], size=(1, 20))
    a, b = Session(ex_t).forward(ids), Session(ex_r).forward(ids)
    assert np.isfinite(ex_t.to_numpy(a)).all()
    assert rel_err(ex_t.to_numpy(a), ex_r.to_numpy(b)) < (1e-4 if not GPU else 3e-3)
