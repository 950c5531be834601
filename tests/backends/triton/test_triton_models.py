"""Whole models on the triton target against independent references.

CPU (``TRITON_INTERPRET=1``, fp32, tiny configs): k3-tiny prefill + decode logits against the
float64 reference backend; a tiny Kimi Linear against transformers' ``KimiLinearForCausalLM``
(its PyTorch path, fla blocked) with weights taken from the peer's in-memory state_dict.
GPU (``gpu``): logits against the torch backend in the same dtype (float32 and bfloat16; prefill,
CUDA-graph decode steps).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.frontend.hf_state_dict import params_from_transformers
from k3ir.runtime import Session

import k3ir

GPU = torch.cuda.is_available()


def test_k3_tiny_prefill_decode_match_reference():
    torch.set_num_threads(1)
    m = k3ir.load("k3-tiny")
    ref = Session(k3ir.compile(m, target="reference"))
    exe = k3ir.compile(m, target="triton", dtype="float32", device="cpu")
    # the MoE chains are one k3.moe_experts each (decode phase): gate/up GEMMs + GLU in one kernel, combine weight
    # in the down GEMM
    assert sum(o.name == "k3.moe_experts" and o.attrs["glu"] for o in exe.module.functions["prefill"].ops) == 8
    tri = Session(exe)
    ids = np.random.default_rng(0).integers(0, 256, (2, 6))
    want, s_ref = ref.prefill(ids)
    got, s_tri = tri.prefill(ids)
    assert rel_err(got.double().numpy(), want) < 1e-4
    for nxt in (np.array([[3], [200]]), np.array([[9], [41]])):     # twice: cached fused weights reused
        want, s_ref = ref.decode(nxt, s_ref)
        got, s_tri = tri.decode(nxt, s_tri)
        assert rel_err(got.double().numpy(), want) < 1e-4
    assert rel_err(got[0].double().numpy(), got[1].double().numpy()) > 1e-2     # rows differ


def _hf_tiny():
    sys.modules.setdefault("fla", None)
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "frontend"))
    from test_kimi_linear_parity import CONFIGS
    torch.manual_seed(3)
    cfg = transformers.KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **CONFIGS["qlora-1shared"])
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("A_log", "dt_bias")):
                continue
            p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g)) if "norm" in n else 0.12 * torch.randn(p.shape,
                                                                                                          generator=g))
    return model, cfg


def test_kimi_linear_tiny_matches_transformers(tmp_path):
    model, cfg = _hf_tiny()
    cfg.save_pretrained(tmp_path)
    module = k3ir.load(str(tmp_path / "config.json"))     # a config without weights (a directory must hold them)
    params = {k: v.detach().clone() for k, v in params_from_transformers(module, model).items()}
    sess = Session(k3ir.compile(module, target="triton", dtype="float32", device="cpu"), params=params)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)))
    with torch.no_grad():
        want = model(ids).logits
    got = sess.forward(ids)
    assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k3-tiny", "kimi-linear-tiny"])
def test_gpu_models_match_torch_backend(name):
    overrides = None
    if name == "kimi-linear-tiny":
        name, overrides = "kimi-linear-6p6b", {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8,
                "moe_intermediate_size": 128, "intermediate_size": 512,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mlp_layer_types": ["dense"] + ["sparse"] * 3,
                "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 2,
                                       "short_conv_kernel_size": 4}}
    m = k3ir.load(name, overrides)
    ids = np.random.default_rng(0).integers(0, 250, (2, 37))
    # float32: Triton's fp32 dots use TF32 (measured 1e-4 / 7e-4); bfloat16: random-weight MoE
    # routing flips between two bf16 runs give 3-4e-2
    for dt, tol in (("float32", 2e-3), ("bfloat16", 5e-2)):
        ref = Session(k3ir.compile(m, target="torch", dtype=dt, device="cuda"))
        tri = Session(k3ir.compile(m, target="triton", dtype=dt, device="cuda"))
        want, s_ref = ref.prefill(ids)
        got, s_tri = tri.prefill(ids)
        assert rel_err(got.float().cpu().numpy(), want.float().cpu().numpy()) < tol, dt
        for step in range(3):       # CUDA-graph decode steps, fed their own state back
            nxt = np.array([[5 + step], [17 + step]])
            want, s_ref = ref.decode(nxt, s_ref)
            got, s_tri = tri.decode(nxt, s_tri)
            assert rel_err(got.float().cpu().numpy(), want.float().cpu().numpy()) < tol, (dt, step)


def test_router_kernel_matches_reference_and_breaks_ties_low():
    from k3ir.backends.triton.kda.layer import router

    from k3ir.ops.moe import router_ref
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 19, 48, generator=g)
    w = torch.randn(24, 48, generator=g) * 0.3
    bias = torch.randn(24, generator=g) * 0.1
    wt, idx, s = router(x, w, bias, 6, True, 2.5, 1e-20)
    rw, ri, rs = router_ref(x.double().numpy(), w.double().numpy(), bias.double().numpy(), 6, True, 2.5, 1e-20)
    assert np.array_equal(idx.numpy(), ri)
    assert rel_err(wt.double().numpy(), rw) < 1e-5 and rel_err(s.double().numpy(), rs) < 1e-5
    # all scores equal: the lowest expert indices win, in order (torch.sort stable)
    wt, idx, _ = router(torch.zeros(3, 48), w, torch.zeros(24), 4, False, 1.0, 1e-20)
    assert idx.tolist() == [[0, 1, 2, 3]] * 3 and np.allclose(wt.numpy(), 0.5)


@pytest.mark.parametrize("splits,lens", [(1, False), (4, False), (8, True)])
def test_mla_decode_split_rows_match_softmax(splits, lens):
    """The latent-cache decode kernel with the rows split over programs (flash-decoding, a second
    launch merges the partial sums) against softmax attention in float64; splits may hold no row."""
    from k3ir.backends.triton.mla.attn import mla_decode
    g = torch.Generator().manual_seed(splits)
    B, H, R, P, L, cap = 2, 3, 32, 16, 37, 64
    qt, qr = torch.randn(B, H, R, generator=g), torch.randn(B, H, P, generator=g)
    cache = torch.randn(B, cap, R + P, generator=g)
    nlen = torch.tensor([L], dtype=torch.int32)
    ln = torch.tensor([L - 9, L]) if lens else None
    got = mla_decode(qt, qr, cache, nlen, 0.2, ln, splits=splits)
    s = (torch.einsum("bhr,blr->bhl", qt.double(), cache[:, :L, :R].double())
         + torch.einsum("bhp,blp->bhl", qr.double(), cache[:, :L, R:].double())) * 0.2
    if lens:
        keep = (torch.arange(L)[None, :] < ln[:, None]) | (torch.arange(L)[None, :] == L - 1)
        s = s.masked_fill(~keep[:, None, :], -float("inf"))
    want = torch.einsum("bhl,blr->bhr", torch.softmax(s, -1), cache[:, :L, :R].double())
    assert rel_err(got.double().numpy(), want.numpy()) < 1e-5


@pytest.mark.parametrize("B,T,k,E,D", [(1, 1, 8, 64, 64), (2, 5, 2, 8, 40), (2, 300, 4, 8, 48), (1, 70, 8, 64, 32)])
def test_dispatch_kernel_matches_reference(B, T, k, E, D):
    """The counting-sort dispatch (one launch for a single slot block, hist/scan/scatter for several)
    against the float64 ``k3.moe_dispatch`` reference: same rows, offsets, inverse and weights."""
    from k3ir.backends.triton.moe.dispatch import moe_dispatch

    from k3ir.opdef import get_opdef
    g = torch.Generator().manual_seed(B * T + k)
    x = torch.randn(B, T, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * T)]).reshape(B, T, k)
    idx[0, 0] = torch.arange(k)                       # ties across tokens keep slot order
    w = torch.rand(B, T, k, generator=g)
    got = moe_dispatch(x, w, idx, E)
    want = get_opdef("k3.moe_dispatch")({"num_experts": E}, []).reference(x.double().numpy(), w.double().numpy(),
                                                                          idx.numpy())
    assert [tuple(t.shape) for t in got] == [tuple(np.shape(t)) for t in want]
    assert np.array_equal(got[1].numpy(), want[1]) and np.array_equal(got[2].numpy(), want[2])
    assert np.array_equal(got[0].double().numpy(), want[0]) and rel_err(got[3].double().numpy(), want[3]) < 1e-7


@pytest.mark.parametrize("B,k,E,D", [(1, 8, 64, 256), (3, 4, 16, 96), (5, 2, 8, 40), (32, 8, 64, 64)])
def test_route_dispatch_matches_router_and_dispatch_reference(B, k, E, D):
    """Decode MoE front in two launches (split router logits, then top-k + dispatch) against the float64
    router and dispatch references."""
    from k3ir.backends.triton.moe.dispatch import route_dispatch

    from k3ir.opdef import get_opdef
    from k3ir.ops.moe import router_ref
    g = torch.Generator().manual_seed(B + k)
    x = torch.randn(B, 1, D, generator=g)
    w = torch.randn(E, D, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.1
    (rw, ri, rs), disp = route_dispatch(x, w, bias, k, E, True, 2.5, 1e-20)
    ww, wi, ws = router_ref(x.double().numpy(), w.double().numpy(), bias.double().numpy(), k, True, 2.5, 1e-20)
    assert np.array_equal(ri.numpy(), wi)
    assert rel_err(rw.double().numpy(), ww) < 1e-5 and rel_err(rs.double().numpy(), ws) < 1e-5
    want = get_opdef("k3.moe_dispatch")({"num_experts": E}, []).reference(x.double().numpy(), ww, wi)
    assert np.array_equal(disp[1].numpy(), want[1]) and np.array_equal(disp[2].numpy(), want[2])
    assert np.array_equal(disp[0].double().numpy(), want[0]) and rel_err(disp[3].double().numpy(), want[3]) < 1e-5


@pytest.mark.parametrize("M,N,K", [(1, 40, 100), (3, 17, 64), (4, 64, 33)])
def test_gemv_epilogues_match_float64(M, N, K):
    """The decode linear (gemv.py): plain, SwiGLU of two weights, two residuals, strided rows."""
    from k3ir.backends.triton.gemv import gemv
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, 1, K + 3, generator=g)[..., :K]            # rows K + 3 apart
    w, w3 = torch.randn(N, K, generator=g), torch.randn(N, K, generator=g)
    r1, r2 = torch.randn(M, 1, N, generator=g), torch.randn(M, 1, N, generator=g)
    xd, wd = x.double(), w.double()
    lin = xd @ wd.T
    assert rel_err(gemv(x, w).double().numpy(), lin.numpy()) < 1e-5
    want = torch.nn.functional.silu(lin) * (xd @ w3.double().T)
    assert rel_err(gemv(x, w, w3).double().numpy(), want.numpy()) < 1e-5
    assert rel_err(gemv(x, w, res=(r1, r2)).double().numpy(), (lin + r1.double() + r2.double()).numpy()) < 1e-5
