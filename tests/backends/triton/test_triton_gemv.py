"""The decode linear (backends/triton/gemv.py) and its fusions against float64 references, under
TRITON_INTERPRET=1 on a CPU machine: RMSNorm prologue (rounded as the standalone norm), SwiGLU, residual
and MoE-combine epilogues, two products in one launch."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.backends.triton.config import get_triton_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rms64(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("M,N,K", [(1, 40, 100), (3, 17, 64), (4, 64, 70)])
def test_gemv_norm_prologue_matches_rmsnorm_then_linear(M, N, K):
    """norm=(w, eps): the row is RMSNorm-ed in the kernel; with a bf16 input the normalised row is
    rounded to bf16 as the standalone rmsnorm kernel rounds it (compared with that two-launch path)."""
    from k3ir.backends.triton.gemv import gemv
    from k3ir.backends.triton.norm import rmsnorm
    g = torch.Generator().manual_seed(M + N)
    x = (torch.randn(M, 1, K, generator=g) * 3).to(DEV)
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(DEV)
    w, w3 = torch.randn(N, K, generator=g).to(DEV), torch.randn(N, K, generator=g).to(DEV)
    r = torch.randn(M, 1, N, generator=g).to(DEV)
    xn = _rms64(x, nw, 1e-5)
    lin = xn @ w.double().T
    assert rel_err(gemv(x, w, norm=(nw, 1e-5)).double().cpu().numpy(), lin.cpu().numpy()) < 1e-5
    glu = torch.nn.functional.silu(lin) * (xn @ w3.double().T)
    assert rel_err(gemv(x, w, w3, norm=(nw, 1e-5)).double().cpu().numpy(), glu.cpu().numpy()) < 1e-5
    got = gemv(x, w, res=(r,), norm=(nw, 1e-5))
    assert rel_err(got.double().cpu().numpy(), (lin + r.double()).cpu().numpy()) < 1e-5
    # bf16: same rounding of the normalised row as rmsnorm_kernel -> gemv
    xb, nb, wb = x.bfloat16(), nw.bfloat16(), w.bfloat16()
    two = gemv(rmsnorm(xb, nb, 1e-5), wb)
    one = gemv(xb, wb, norm=(nb, 1e-5))
    assert rel_err(one.double().cpu().numpy(), two.double().cpu().numpy()) < 1e-2
    assert rel_err(one.double().cpu().numpy(), (_rms64(xb, nb, 1e-5) @ wb.double().T).cpu().numpy()) < 2e-2


@pytest.mark.parametrize("M,k,S", [(1, 8, 8), (3, 2, 7)])
def test_gemv_combine_epilogue_matches_float64(M, k, S):
    """comb=(y_sorted, inv): sum of the k pre-scaled expert rows of each token plus a residual."""
    from k3ir.backends.triton.gemv import gemv
    g = torch.Generator().manual_seed(M * k)
    N, K = 48, 96
    x, w = torch.randn(M, 1, K, generator=g).to(DEV), torch.randn(N, K, generator=g).to(DEV)
    ys = torch.randn(max(S, M * k), N, generator=g).to(DEV)
    inv = torch.randint(0, ys.shape[0], (M, 1, k), generator=g).to(DEV)
    r = torch.randn(M, 1, N, generator=g).to(DEV)
    want = x.double() @ w.double().T + r.double() + ys.double()[inv].sum(2)
    got = gemv(x, w, res=(r,), comb=(ys, inv))
    assert rel_err(got.double().cpu().numpy(), want.cpu().numpy()) < 1e-5


def test_gemv2_two_products_one_launch():
    """gemv2: x W^T and x2 W2^T (different N, same K and rows; strided column slices as inputs)."""
    from k3ir.backends.triton.gemv import gemv2
    g = torch.Generator().manual_seed(7)
    big = torch.randn(2, 1, 200, generator=g).to(DEV)
    x, x2 = big[..., :64], big[..., 100:164]
    w, w2 = torch.randn(40, 64, generator=g).to(DEV), torch.randn(70, 64, generator=g).to(DEV)
    y, y2 = gemv2(x, w, x2, w2)
    assert y.shape == (2, 1, 40) and y2.shape == (2, 1, 70)
    assert rel_err(y.double().cpu().numpy(), (x.double() @ w.double().T).cpu().numpy()) < 1e-5
    assert rel_err(y2.double().cpu().numpy(), (x2.double() @ w2.double().T).cpu().numpy()) < 1e-5


def test_gemv_launch_config_covers_the_kimi_linear_shapes(monkeypatch):
    """GPU configs (not the interpreter's): one K step for K <= 2048 rows of x, >= 4 rows per program,
    ~8k weight elements per tile and row."""
    from k3ir.backends.triton import gemv as gm
    if gm.interpreting():
        with monkeypatch.context() as mp:
            mp.delenv("TRITON_INTERPRET")
            cfgs = {s: gm.config(*s) for s in [(1, 6416, 2048, False), (1, 1024, 2048, True), (1, 2048, 128, False),
                                               (1, 2048, 8192, False), (4, 2048, 2048, False)]}
    else:
        cfgs = {s: gm.config(*s) for s in [(1, 6416, 2048, False), (1, 1024, 2048, True), (1, 2048, 128, False),
                                           (1, 2048, 8192, False), (4, 2048, 2048, False)]}
    if get_triton_config().decode.gemv is not None:
        pytest.skip("K3IR_GEMV overrides the configs")
    assert cfgs[(1, 6416, 2048, False)] == (4, 2048, 4)
    assert cfgs[(1, 1024, 2048, True)] == (2, 2048, 4)
    assert cfgs[(1, 2048, 128, False)] == (16, 128, 4)
    assert cfgs[(1, 2048, 8192, False)] == (4, 2048, 4)
    assert cfgs[(4, 2048, 2048, False)] == (4, 512, 4)


def test_combine_add_matches_float64():
    """combine_add: a prefill linear's output + two residuals + the MoE combine of pre-scaled rows, one pass."""
    from k3ir.backends.triton.gemv import combine_add
    g = torch.Generator().manual_seed(11)
    B, T, N, k = 2, 9, 40, 3
    y, r1, r2 = (torch.randn(B, T, N, generator=g).to(DEV) for _ in range(3))
    ys = torch.randn(B * T * k, N, generator=g).to(DEV)
    inv = torch.randperm(B * T * k, generator=g).reshape(B, T, k).to(DEV)
    want = y.double() + r1.double() + r2.double() + ys.double()[inv].sum(2)
    assert rel_err(combine_add(y, (r1, r2), ys, inv).double().cpu().numpy(), want.cpu().numpy()) < 1e-6
    assert rel_err(combine_add(y, (r1,), ys, inv).double().cpu().numpy(), (want - r2.double()).cpu().numpy()) < 1e-6


@pytest.mark.parametrize("M,W,sizes,extra", [(1, 4, (32, 32, 48), 20), (3, 3, (16, 24, 16), 5)])
def test_gemv_conv_epilogue_matches_float64_and_updates_state_in_place(M, W, sizes, extra):
    """conv=(w_conv, pools, slots, sizes): the q|k|v columns go through the short-conv decode step + SiLU
    (SPEC.md 3.2) with the pre-conv input rounded to y's dtype; each pool's rows at ``slots`` are shifted in
    place (oldest tap dropped, the new input last), every other slot stays bit-identical; the other
    columns are the plain product."""
    from k3ir.backends.triton.gemv import gemv
    g = torch.Generator().manual_seed(M * W)
    K, P = 64, 5
    C = sum(sizes)
    N = C + extra
    x = torch.randn(M, K, generator=g).to(DEV)
    w = (torch.randn(N, K, generator=g) / 8).to(DEV)
    cw = torch.randn(C, 1, W, generator=g).to(DEV)
    pools = [torch.randn(P, c, W - 1, generator=g).to(DEV) for c in sizes]
    before = [p.clone() for p in pools]
    slots = torch.tensor([4, 0, 2][:M], dtype=torch.int32, device=DEV)
    y = gemv(x, w, conv=(cw, pools, slots, sizes))
    lin = x.double() @ w.double().T
    want = lin.clone()
    c0 = 0
    for p, b, c in zip(pools, before, sizes):
        for m, s in enumerate(slots.tolist()):
            full = torch.cat([b[s].double(), lin[m, c0:c0 + c, None]], 1)
            a = (full * cw[c0:c0 + c, 0].double()).sum(1)
            want[m, c0:c0 + c] = a * torch.sigmoid(a)
            assert rel_err(p[s].double().cpu().numpy(), full[:, 1:].cpu().numpy()) < 1e-6
        for s in set(range(P)) - set(slots.tolist()):
            assert torch.equal(p[s], b[s])
        c0 += c
    assert rel_err(y.double().cpu().numpy(), want.cpu().numpy()) < 1e-5


@pytest.mark.parametrize("M,H,V,N", [(1, 4, 16, 24), (2, 2, 32, 40), (4, 8, 8, 16)])
def test_gemv_gated_norm_prologue_matches_float64(M, H, V, N):
    """norm=(w [V], gz, eps, "gated"): each head of V columns is RMSNorm-ed, scaled by w and gated by
    sigmoid(gz) (SPEC.md 3.6) before the product, against float64 (fp32 rows; bf16 rows vs the
    standalone gated_rmsnorm kernel then the gemv)."""
    from k3ir.backends.triton.gemv import gemv
    from k3ir.backends.triton.kda.layer import gated_rmsnorm
    g = torch.Generator().manual_seed(M * H + V)
    K = H * V
    o = (3 * torch.randn(M, K, generator=g)).to(DEV)
    gz = torch.randn(M, K, generator=g).to(DEV)
    nw = (1 + 0.3 * torch.randn(V, generator=g)).to(DEV)
    w = (torch.randn(N, K, generator=g) / 8).to(DEV)
    od = o.double().reshape(M, H, V)
    xn = od * torch.rsqrt(od.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double() * torch.sigmoid(
        gz.double().reshape(M, H, V))
    want = xn.reshape(M, K) @ w.double().T
    assert rel_err(gemv(o, w, norm=(nw, gz, 1e-6, "gated")).double().cpu().numpy(), want.cpu().numpy()) < 1e-5
    ob, gb, wb = o.bfloat16(), gz.bfloat16(), w.bfloat16()
    two = gemv(gated_rmsnorm(ob.reshape(M, H, V), gb.reshape(M, H, V), nw, 1e-6).reshape(M, K), wb)
    one = gemv(ob, wb, norm=(nw, gb, 1e-6, "gated"))
    assert rel_err(one.double().cpu().numpy(), two.double().cpu().numpy()) < 1e-2
