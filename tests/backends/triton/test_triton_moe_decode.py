"""The decode MoE GLU launch that routes itself (moe_decode.routed_glu_kernel, TritonConfig.decode.routed_glu):
routing bit-identical to dispatch_kernel's ROUTE (expert ids, weights, scores, offsets, inv, combine weights), the
GLU rows the same bits as dispatch + grouped_matmul, and against float64 (TRITON_INTERPRET=1 on a CPU machine)."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
triton = pytest.importorskip("triton")

from conftest import rel_err
from k3ir.backends.triton.config import triton_config


@pytest.fixture
def decode_tuning():
    """Overrides of ``TritonConfig.decode`` for the test, undone after it."""
    from _triton_config import section_overrides
    with section_overrides("decode") as over:
        yield over


DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: float32 GEMMs run as TF32 on the GPU: looser tolerances there (as tests/backends/triton/test_triton_moe.py)
TOL_GLU, TOL_MODEL = (2e-2, 2e-3) if DEV == "cuda" else (1e-5, 1e-4)


def _layer(B, k, E, D, NS, I, seed):
    g = torch.Generator().manual_seed(seed)
    nw = 1 + 0.3 * torch.randn(D, generator=g)
    wr = torch.randn(E, D, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.1
    s1, s3 = torch.randn(NS, D, generator=g) * 0.1, torch.randn(NS, D, generator=g) * 0.1
    w1, w3 = torch.randn(E, I, D, generator=g) * 0.1, torch.randn(E, I, D, generator=g) * 0.1
    x = torch.randn(B, 1, D, generator=g) * 4
    if B > 1:       # two tokens with the same row: the same experts, so experts with 2+ rows and ties in the sort
        x[1] = x[0]
    return [t.to(DEV) for t in (x, nw, wr, bias, s1, s3, w1, w3)]


@pytest.mark.parametrize("use_xn", [False, True])
@pytest.mark.parametrize("B,k,E,D,I,act", [(1, 8, 64, 96, 32, "silu"), (3, 2, 8, 40, 24, "situ"),
                                           (4, 4, 16, 64, 16, "silu")])
def test_routed_glu_equals_dispatch_then_grouped_glu(B, k, E, D, I, act, use_xn, decode_tuning):
    """Same front (router_glu_kernel) routed twice: by dispatch_kernel (+ grouped_matmul on its sorted copy) and by
    routed_glu_kernel. Router outputs, offsets, inv, combine weights must be equal bit for bit, and the GLU rows too
    when the routed GLU norms the raw rows (xn False); with router_glu_kernel's normalised rows (xn True, one-pass
    rstd) within fp32 rounding. Expert ids, GLU rows and those normalised rows also against float64."""
    from k3ir.backends.triton.moe import decode as moe_decode
    from k3ir.backends.triton.moe import dispatch as disp
    from k3ir.backends.triton.moe import grouped as moe

    from k3ir.ops.moe import router_ref
    decode_tuning["routed_glu"] = True
    x, nw, wr, bias, s1, s3, w1, w3 = _layer(B, k, E, D, 12, I, seed=B * 7 + k)
    args = (x, wr, bias, k, E, True, 2.5, 1e-20, (nw, 1e-5), s1, s3)
    f_old, y_old = disp.router_glu_front(*args)
    rout, (xs, off, inv, cw), _ = disp.dispatch_front(f_old)
    h_old = moe.grouped_matmul(xs, off, w1, w3=w3, act=act)
    f_new, y_new = disp.router_glu_front(*args, write_xn=use_xn)
    assert (f_new.xn is not None) == use_xn
    assert moe_decode.routed_supported(f_new, w1, w3, act)
    rout2, (off2, inv2, cw2), h_new = moe_decode.routed_glu(f_new, w1, w3, act)
    assert torch.equal(y_old, y_new)
    for a, b in zip((*rout, off, inv, cw), (*rout2, off2, inv2, cw2)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert h_old.shape == h_new.shape and h_old.dtype == h_new.dtype
    if use_xn:
        assert rel_err(h_new.double().cpu().numpy(), h_old.double().cpu().numpy()) < (TOL_GLU if DEV == "cuda" else 1e-6)
    else:
        assert torch.equal(h_old, h_new)
    # independent check: float64 norm, router and GLU per slot
    xd = x.double().cpu()
    xn = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double().cpu()).numpy()
    ww, wi, _ = router_ref(xn, wr.double().cpu().numpy(), bias.double().cpu().numpy(), k, True, 2.5, 1e-20)
    if use_xn:
        assert rel_err(f_new.xn.double().cpu().numpy(), xn.reshape(B, D)) < 1e-6
    assert np.array_equal(rout2[1].cpu().numpy(), wi) and rel_err(rout2[0].double().cpu().numpy(), ww) < 1e-5
    W1, W3 = w1.double().cpu().numpy(), w3.double().cpu().numpy()
    for b in range(B):
        for j in range(k):
            e, row = wi[b, 0, j], int(inv2[b, 0, j])
            gt, up = W1[e] @ xn[b, 0], W3[e] @ xn[b, 0]
            if act == "silu":
                want = gt / (1 + np.exp(-gt)) * up
            else:
                want = 4 * np.tanh(gt / 4) / (1 + np.exp(-gt)) * 25 * np.tanh(up / 25)
            assert rel_err(h_new[row].double().cpu().numpy(), want) < TOL_GLU, (b, j)
            assert cw2[row] == rout2[0][b, 0, j]


def test_routed_glu_switch_and_limits(decode_tuning):
    """Off with decode.routed_glu False, more than MAX_ROWS tokens, packed or float64 weights, no GLU."""
    from k3ir.backends.triton.moe import decode as moe_decode
    from k3ir.backends.triton.moe import dispatch as disp
    decode_tuning["routed_glu"] = True
    x, nw, wr, bias, s1, s3, w1, w3 = _layer(1, 2, 8, 32, 8, 16, seed=1)
    f, _ = disp.router_glu_front(x, wr, bias, 2, 8, True, 1.0, 1e-20, (nw, 1e-5), s1, s3)
    assert moe_decode.routed_supported(f, w1, w3, "silu")
    assert not moe_decode.routed_supported(f, w1, w3, "none")
    assert not moe_decode.routed_supported(f, w1.double(), w3.double(), "silu")
    assert not moe_decode.routed_supported(f, w1[..., :16].to(torch.uint8), w3[..., :16].to(torch.uint8), "silu")
    with triton_config(decode={"routed_glu": False}):
        assert not moe_decode.routed_supported(f, w1, w3, "silu")
    xb = torch.randn(moe_decode.MAX_ROWS + 1, 1, 32, device=DEV)
    fb, _ = disp.router_glu_front(xb, wr, bias, 2, 8, True, 1.0, 1e-20, (nw, 1e-5), s1, s3)
    assert not moe_decode.routed_supported(fb, w1, w3, "silu")


@pytest.mark.slow
def test_whole_model_decode_with_the_routed_glu_matches_reference_and_drops_dispatch(decode_tuning):
    """A tiny Kimi Linear (3 MoE layers with a shared expert) on the triton target, float32: decode steps with
    decode.routed_glu on (no dispatch_kernel launch: the grouped GLU routes; with routed_xn on or off) against the
    float64 reference backend, bit for bit against the same steps with it off (dispatch_kernel + grouped GLU) when
    the routed GLU norms the raw rows itself; also the step as a CUDA graph runs it (static buffers, graph_ctx),
    emulated eagerly."""
    from k3ir.backends.triton.graphs import GraphDecode
    from k3ir.runtime import Session
    from test_triton_decode_fusion import KL, _count_launches

    import k3ir
    torch.set_num_threads(1)
    decode_tuning["front_split"] = True
    m = k3ir.load("kimi-linear-6p6b", KL)
    exe = k3ir.compile(m, target="triton", dtype="float32", device=DEV)
    assert sum(o.name == "k3.moe_front" and o.attrs["routed_glu"] for o in exe.module.functions["decode"].ops) == 3
    ref = Session(k3ir.compile(m, target="reference"))
    tri = Session(exe, params=ref.params)
    ids = np.random.default_rng(1).integers(3, 500, (3, 5))
    _, s_ref = ref.prefill(ids)
    _, s_tri = tri.prefill(ids)
    nxt = np.array([[7], [7], [300]])          # two rows alike: experts with two rows
    want, _ = ref.decode(nxt, s_ref)
    got, launches = {}, {}
    for on, xn in ((True, False), (True, True), (False, False)):
        decode_tuning["routed_glu"] = on
        decode_tuning["routed_xn"] = xn
        res = {}
        launches[on, xn] = _count_launches(lambda res=res: res.update(r=tri.decode(nxt, s_tri)))
        got[on, xn] = res["r"][0]
        assert rel_err(got[on, xn].double().cpu().numpy(), want) < TOL_MODEL, (on, xn)
    assert torch.equal(got[True, False], got[False, False])     # the routed GLU norming raw rows: the same bits
    assert rel_err(got[True, True].double().cpu().numpy(), got[False, False].double().cpu().numpy()) < TOL_MODEL / 10
    for key in ((True, False), (True, True)):
        assert launches[key]["routed_glu_kernel"] == 3 and launches[key]["dispatch_kernel"] == 0
        assert launches[key]["grouped_gemm_t_kernel"] == 3 and launches[key]["router_glu_kernel"] == 3
        assert launches[key]["rmsnorm_kernel"] == launches[False, False]["rmsnorm_kernel"]
    assert launches[False, False]["routed_glu_kernel"] == 0 and launches[False, False]["dispatch_kernel"] == 3
    assert launches[False, False]["grouped_gemm_t_kernel"] == 6
    decode_tuning["routed_glu"] = True
    decode_tuning["routed_xn"] = True
    gd = GraphDecode(exe)                      # as a CUDA graph captures it: static inputs, lengths on the device
    targs = [torch.as_tensor(nxt, device=DEV)] + [s_tri.values[n].clone() for n in s_tri.names]
    L = s_tri.length
    static = [targs[0]] + [gd._static_state(i, targs[i], 64) for i in range(1, len(targs))]
    exe.graph_ctx = {"pos": torch.tensor([L], device=DEV), "nlen": torch.tensor([L + 1], dtype=torch.int32,
                                                                                device=DEV)}
    try:
        outs = exe._run_eager("decode", static, tri.params)
    finally:
        exe.graph_ctx = None
    assert torch.equal(outs[0], got[True, True])
