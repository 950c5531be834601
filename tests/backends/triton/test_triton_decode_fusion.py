"""Decode-step fusions of the triton target (the decode phase's fused ops: k3.decode_linear, k3.moe_front,
k3.moe_experts, k3.fused_kda_ungated with its input norm, k3.mla_kv_norm) on a tiny Kimi Linear:
RMSNorm deferred into the gemv prologue (KDA projections, MLA q/kv_a, dense MLP), the MLA q and kv_a
linears in one gemv over concatenated weights, the MoE combine summed in the shared-expert down gemv,
the KDA low-rank up-projections in one launch. Logits against the float64 reference backend, launches
counted per kernel (TRITON_INTERPRET=1 on a CPU machine)."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
triton = pytest.importorskip("triton")

from conftest import rel_err
from helpers import kernel_name, triton_launches
from k3ir.backends.triton.config import triton_config
from k3ir.runtime import Session

import k3ir

KL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
      "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 64,
      "layer_types": ["linear_attention"] * 3 + ["full_attention"],
      "mlp_layer_types": ["dense"] + ["sparse"] * 3,
      "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 64, "num_heads": 2,
                             "short_conv_kernel_size": 4}}


def _count_launches(work):
    """{kernel name: launches} of the Triton kernels ``work()`` runs."""
    seen = collections.Counter()

    def count(launch, fn, args, warmup, kw):
        if not warmup:
            seen[kernel_name(fn)] += 1
        return launch()
    with triton_launches(count):
        work()
    return seen


@pytest.fixture
def decode_tuning():
    """Overrides of ``TritonConfig.decode`` for the test, undone after it."""
    from _triton_config import section_overrides
    with section_overrides("decode") as over:
        yield over


@pytest.mark.slow
def test_kimi_linear_decode_fusions_match_reference_and_save_launches(decode_tuning):
    torch.set_num_threads(1)
    m = k3ir.load("kimi-linear-6p6b", KL)
    exe = k3ir.compile(m, target="triton", dtype="float32", device="cpu")
    # the decode phase's IR: the 3 KDA input norms in the layers (norm="rms"), the 3 MoE norms and shared-expert
    # SwiGLUs in their k3.moe_front, the MoE combines in the shared-expert down projections (combine), the MLA
    # input norm (q and kv_a in one k3.decode_linear), the dense MLP norm (its SwiGLU), the KDA output norms
    # (o_proj prologues) and the MLA latent norm (k3.mla_kv_norm)
    ops = exe.module.functions["decode"].ops
    assert sum(o.name == "k3.fused_kda_ungated" and o.attrs["norm"] == "rms" for o in ops) == 3
    fronts = [o for o in ops if o.name == "k3.moe_front"]
    assert len(fronts) == 3 and all(o.attrs["norm"] == "rms" and o.attrs["shared_glu"] for o in fronts)
    names = collections.Counter(o.name for o in ops)
    assert names["k3.rmsnorm"] == 1 and names["k3.router"] == names["k3.moe_dispatch"] == 0   # the final norm
    dl = collections.Counter((o.attrs["norm"], o.attrs["glu"], o.attrs["splits"], o.attrs["residuals"],
                              o.attrs["combine"]) for o in ops if o.name == "k3.decode_linear")
    assert dl[("rms", False, 2, 0, False)] == 1 and dl[("rms", True, 1, 0, False)] == 1
    assert dl[("none", False, 1, 1, True)] == 3
    assert dl[("gated", False, 1, 1, False)] == 3 and sum(o.name == "k3.mla_kv_norm" for o in ops) == 1
    ref = Session(k3ir.compile(m, target="reference"))
    tri = Session(exe, params=ref.params)
    ids = np.random.default_rng(0).integers(3, 500, (2, 7))
    want, s_ref = ref.prefill(ids)
    out = {}
    pre = _count_launches(lambda: out.update(r=tri.prefill(ids)))
    got, s_tri = out["r"]
    assert rel_err(got.double().numpy(), want) < 1e-4
    # prefill: each MoE layer's combine + shared-expert residual adds in one pass after the cuBLAS linear
    assert pre["combine_add_kernel"] == 3 and pre["combine_kernel"] == 0
    nxt = np.array([[5], [40]])
    want, s_ref = ref.decode(nxt, s_ref)
    out = {}
    from k3ir.backends.triton import gemv as gemv_mod
    fused = collections.Counter()
    launch = gemv_mod._launch

    def spy(*a, **kw):       # the gemv fusions of TritonConfig.decode.split: conv epilogue, gated-norm prologue
        fused.update(k for k in ("conv", "gnorm") if kw.get(k) is not None)
        return launch(*a, **kw)
    gemv_mod._launch = spy
    try:
        launches = _count_launches(lambda: out.update(r=tri.decode(nxt, s_tri)))
    finally:
        gemv_mod._launch = launch
    assert fused == {"conv": 3, "gnorm": 3}
    got, s_tri = out["r"]
    assert rel_err(got.double().numpy(), want) < 1e-4
    want, _ = ref.decode(nxt[::-1].copy(), s_ref)          # the next step from the fused step's state
    got, _ = tri.decode(nxt[::-1].copy(), s_tri)
    assert rel_err(got.double().numpy(), want) < 1e-4
    # the same step as a CUDA graph captures it (graphs.GraphDecode: static state buffers updated in place,
    # the MLA cache a preallocated buffer, its length on the device), emulated eagerly on the CPU
    from k3ir.backends.triton.graphs import GraphDecode
    gd = GraphDecode(exe)
    targs = [torch.as_tensor(nxt[::-1].copy())] + [s_tri.values[n].clone() for n in s_tri.names]
    L = s_tri.length
    static = [targs[0]] + [gd._static_state(i, targs[i], 64) for i in range(1, len(targs))]
    exe.graph_ctx = {"pos": torch.tensor([L]), "nlen": torch.tensor([L + 1], dtype=torch.int32)}
    try:
        outs = exe._run_eager("decode", static, tri.params)
    finally:
        exe.graph_ctx = None
    assert rel_err(outs[0].double().numpy(), want) < 1e-4
    mla = next(i for i, k in enumerate(gd.kinds) if k == "mla_cache")
    assert outs[mla] is static[mla] and float(static[mla][:, L + 1:].abs().max()) == 0.0   # row L written in place
    # rmsnorm launches: the final norm only (MoE norms in the router front, MLA's latent norm in its prologue);
    # the MoE front by default (decode.front_split): router partial logits + shared
    # gate/up in one launch, then the dispatch; gemv: KDA 3 x (projections, the low-rank pair (gemv2), out),
    # MLA (q+kv_a, out), dense (glu, down), 3 x shared down
    assert launches["rmsnorm_kernel"] == 1
    # decode.routed_glu (K3IR_MOE_ROUTED_GLU=1): the grouped GLU launch routes, no dispatch_kernel
    routed = decode_tuning["routed_glu"]
    assert launches["router_glu_kernel"] == 3 and launches["dispatch_kernel"] == (0 if routed else 3)
    assert launches["routed_glu_kernel"] == (3 if routed else 0)
    assert launches["router_partial_kernel"] == 0 and launches["gemv_kernel"] == 3 * 3 + 2 + 2 + 3
    assert launches["combine_kernel"] == 0
    assert launches["mla_absorb_q_kernel"] == 1 and launches["mla_decode_out_kernel"] == 1
    # decode.split: the KDA short conv in the projection gemv, the gated head norm in the o_proj gemv
    assert launches["kda_decode_kernel"] == 3 and launches["gated_rmsnorm_kernel"] == 0
    with triton_config(decode={"split": False}):    # the one-launch path (conv and norm inside kda_decode) matches
        got, _ = tri.decode(nxt[::-1].copy(), s_tri)
    assert rel_err(got.double().numpy(), want) < 1e-4
    with triton_config(decode={"front_split": False}):   # router_partial + dispatch + shared gate/up gemv (3 launches)
        launches = _count_launches(lambda: out.update(r=tri.decode(nxt[::-1].copy(), s_tri)))
    assert launches["router_glu_kernel"] == 0 and launches["router_partial_kernel"] == 3
    assert launches["dispatch_kernel"] == 3 and launches["gemv_kernel"] == 3 * 3 + 2 + 2 + 3 * 2
    assert rel_err(out["r"][0].double().numpy(), want) < 1e-4


@pytest.mark.parametrize("B,k,E,D", [(1, 8, 64, 256), (3, 2, 8, 40)])
def test_route_dispatch_with_the_rmsnorm_fused_matches_float64(B, k, E, D):
    """route_dispatch(norm=...): the MoE layer's RMSNorm in the router front (partial sums of x^2 per
    split, rstd applied to the logits and the copied rows) against the float64 norm, router and dispatch."""
    from k3ir.backends.triton.moe.dispatch import route_dispatch

    from k3ir.opdef import get_opdef
    from k3ir.ops.moe import router_ref
    g = torch.Generator().manual_seed(B * k)
    x = torch.randn(B, 1, D, generator=g) * 4
    nw = 1 + 0.3 * torch.randn(D, generator=g)
    w = torch.randn(E, D, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.1
    (rw, ri, rs), disp, xn = route_dispatch(x, w, bias, k, E, True, 2.5, 1e-20, norm=(nw, 1e-5))
    xd = x.double()
    want_xn = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()).numpy()
    assert rel_err(xn.double().numpy(), want_xn) < 1e-6
    ww, wi, ws = router_ref(want_xn, w.double().numpy(), bias.double().numpy(), k, True, 2.5, 1e-20)
    assert np.array_equal(ri.numpy(), wi)
    assert rel_err(rw.double().numpy(), ww) < 1e-5 and rel_err(rs.double().numpy(), ws) < 1e-5
    want = get_opdef("k3.moe_dispatch")({"num_experts": E}, []).reference(want_xn, ww, wi)
    assert np.array_equal(disp[1].numpy(), want[1]) and np.array_equal(disp[2].numpy(), want[2])
    assert rel_err(disp[0].double().numpy(), want[0]) < 1e-6 and rel_err(disp[3].double().numpy(), want[3]) < 1e-5


@pytest.mark.parametrize("B,L,splits_cap,kvn", [(1, 5, 64, False), (2, 37, 1024, False), (2, 9, 64, True)])
def test_mla_decode_absorbed_matches_float64_attention(B, L, splits_cap, kvn):
    """mla_decode_absorbed (q absorbed into the latent + cache-row write, attention, merge + W_uv) against
    float64 attention over the up-projected keys/values of the cache with the step's row appended."""
    from k3ir.backends.triton.mla.attn import mla_decode_absorbed
    g = torch.Generator().manual_seed(B * L)
    H, N, P, VD, R = 3, 16, 8, 12, 32
    q = torch.randn(B, 1, H * (N + P) + 5, generator=g)[..., :H * (N + P)].reshape(B, 1, H, N + P)   # strided rows
    kv = torch.randn(B, 1, R + P, generator=g)
    w = torch.randn(H * (N + VD), R, generator=g) * 0.3
    cache = torch.zeros(B, splits_cap, R + P)
    cache[:, :L] = torch.randn(B, L, R + P, generator=g)
    if kvn:         # kv given as the raw latent + rope key: the latent RMSNorm and the concat in the kernel
        raw = torch.randn(B, 1, R + P + 3, generator=g) * 3
        nw = 1 + 0.3 * torch.randn(R, generator=g)
        lat = raw[..., :R].double()
        kv = torch.cat([lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double(),
                        raw[..., R:R + P].double()], -1).float()
        o = mla_decode_absorbed(q, raw[..., :R], w, cache, torch.tensor([L]), torch.tensor([L + 1], dtype=torch.int32),
                                H, N, VD, 0.3, kv_norm=(raw[..., R:R + P], nw, 1e-6))
    else:
        o = mla_decode_absorbed(q, kv, w, cache, torch.tensor([L]), torch.tensor([L + 1], dtype=torch.int32), H, N,
                                VD, 0.3)
    assert rel_err(cache[:, L].double().numpy(), kv[:, 0].double().numpy()) < 1e-6   # the step's row, in place
    c = cache[:, :L + 1].double()
    wh = w.double().reshape(H, N + VD, R)
    k_nope = torch.einsum("blr,hnr->blhn", c[..., :R], wh[:, :N])
    v = torch.einsum("blr,hvr->blhv", c[..., :R], wh[:, N:])
    qd = q.double()[:, 0]
    s = (torch.einsum("bhn,blhn->bhl", qd[..., :N], k_nope) + torch.einsum("bhp,blp->bhl", qd[..., N:], c[..., R:])) * 0.3
    want = torch.einsum("bhl,blhv->bhv", torch.softmax(s, -1), v)
    assert o.shape == (B, 1, H, VD)
    assert rel_err(o[:, 0].double().numpy(), want.numpy()) < 1e-5


@pytest.mark.parametrize("B,k,E,D,NS", [(1, 8, 64, 256, 48), (3, 2, 8, 40, 20)])
def test_moe_front_two_launches_matches_float64_and_route_dispatch(B, k, E, D, NS):
    """route_glu_dispatch (router_glu_kernel: router partial logits + shared-expert SwiGLU gate/up of the
    RMSNorm-ed rows in one launch, then dispatch_kernel) against the float64 norm, router, dispatch and SwiGLU,
    and against route_dispatch (the same experts, rows and sorted x; weights up to the fp32 summation order)."""
    from k3ir.backends.triton.moe import dispatch as disp

    from k3ir.opdef import get_opdef
    from k3ir.ops.moe import router_ref
    g = torch.Generator().manual_seed(B * k + D + 1)
    nw = 1 + 0.3 * torch.randn(D, generator=g)
    w = torch.randn(E, D, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.1
    w1, w3 = torch.randn(NS, D, generator=g) * 0.1, torch.randn(NS, D, generator=g) * 0.1
    assert disp.split_supported(B, E, k, torch.zeros(B, 1, D), w1, w3, w)
    x = torch.randn(B, 1, D, generator=g) * 4
    (rw, ri, rs), dout, y, xn_t = disp.route_glu_dispatch(x, w, bias, k, E, True, 2.5, 1e-20, (nw, 1e-5), w1, w3)
    xd = x.double()
    xn = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()).numpy()
    ww, wi, ws = router_ref(xn, w.double().numpy(), bias.double().numpy(), k, True, 2.5, 1e-20)
    assert np.array_equal(ri.numpy(), wi)
    assert rel_err(rw.double().numpy(), ww) < 1e-5 and rel_err(rs.double().numpy(), ws) < 1e-5
    want = get_opdef("k3.moe_dispatch")({"num_experts": E}, []).reference(xn, ww, wi)
    assert np.array_equal(dout[1].numpy(), want[1]) and np.array_equal(dout[2].numpy(), want[2])
    assert rel_err(dout[0].double().numpy(), want[0]) < 1e-6 and rel_err(dout[3].double().numpy(), want[3]) < 1e-5
    assert rel_err(xn_t.double().numpy(), xn) < 1e-6
    xnt = torch.from_numpy(xn)
    a, b = xnt @ w1.double().T, xnt @ w3.double().T
    assert rel_err(y.double().numpy(), (a * torch.sigmoid(a) * b).numpy()) < 1e-5
    (rw2, ri2, _), dout2, xn2 = disp.route_dispatch(x, w, bias, k, E, True, 2.5, 1e-20, norm=(nw, 1e-5))
    assert torch.equal(ri, ri2) and torch.equal(xn_t, xn2) and rel_err(rw.numpy(), rw2.numpy()) < 1e-6
    assert all(torch.equal(dout[i], dout2[i]) for i in (0, 1, 2))
