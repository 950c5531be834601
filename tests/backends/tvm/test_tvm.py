"""The ``tvm`` target (Relax on llvm) against the float64 reference and the torch backend.

Compiled modules are cached per process (symbolic batch/length: one build per model), and the
tests build at LLVM opt level 0 (3x faster builds, same numerics) in a ``tvm_config`` scope (conftest's
``tvm_opt_level_0``), not through the environment."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytestmark = pytest.mark.usefixtures("tvm_opt_level_0")

from _tiny_models import load_tiny, route_sessions, token_ids
from conftest import rel_err
from k3ir.runtime import Session

import k3ir
from k3ir.errors import K3BackendError


def _sessions(key: str):
    return route_sessions(key, "tvm-llvm", dtype="float32")


@pytest.mark.parametrize("key", [pytest.param("k3-tiny", marks=pytest.mark.slow), "kimi-linear-tiny"])
def test_tvm_greedy_generation_matches_torch(key):
    m, params, _, _, sess = _sessions(key)
    torch_sess = Session(k3ir.compile(m, target="torch", dtype="float32"), params=params)
    prompt = token_ids(m.attrs["vocab_size"], 2, 7, seed=11)
    want = torch_sess.generate(prompt, max_new_tokens=16)
    got = sess.generate(prompt, max_new_tokens=16)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("key,quant", [("k3-tiny", None), ("kimi-linear-tiny", None), ("k3-tiny", "mxfp4")])
def test_prefill_then_decode_steps_match_reference(key, quant):
    """Prefill 7 tokens then 16 decode steps carrying the state: every step's float32 logits within 1e-4
    (SPEC.md 11) of the float64 reference on the same weights; the greedy tokens equal the torch backend's."""
    from k3ir.passes.pipelines import pipeline_for
    from k3ir.passes.quantize_experts import materialize
    from k3ir.runtime.params import init_params
    if quant is None:
        m, params, ref, _, sess = _sessions(key)
    else:
        m = load_tiny(key)
        params = init_params(m, seed=3)
        exe = k3ir.compile(m, target="tvm", dtype="float32", quantize=quant)
        params = {**params, **materialize(exe.module, lambda src, t: params[src])}     # the packed experts
        sess = Session(exe, params=params)
        ref = Session(k3ir.compile(m, target="reference", dtype="float64", passes=pipeline_for("tvm"), quantize=quant),
                      params=params)                # the same packed experts, dequantised in float64
    ids = token_ids(m.attrs["vocab_size"], 1, 7, seed=5)
    (got, st), (want, st_ref) = sess.prefill(ids), ref.prefill(ids)
    assert rel_err(got, want) < 1e-4
    for step in range(16):
        tok = want[:, -1:].double().numpy().argmax(-1)
        (got, st), (want, st_ref) = sess.decode(tok, st), ref.decode(tok, st_ref)
        assert rel_err(got, want) < 1e-4, f"decode step {step}"
    torch_sess = Session(k3ir.compile(m, target="torch", dtype="float32", quantize=quant), params=params)
    assert sess.generate(ids, max_new_tokens=16).tolist() == torch_sess.generate(ids, max_new_tokens=16).tolist()


def test_symbolic_shapes_need_no_recompile():
    """Batch 1 and 3, lengths 5 and 2 run on the same compiled prefill/decode functions."""
    from k3ir.backends import tvm as tb
    m, _, ref, _, sess = _sessions("kimi-linear-tiny")
    before = len(tb._COMPILED)
    for B, T in ((1, 5), (3, 2)):
        ids = token_ids(m.attrs["vocab_size"], B, T, seed=B)
        got, state = sess.prefill(ids)
        want, _ = ref.prefill(ids)
        assert rel_err(got, want) < 1e-4
        cache = next(n for n in state.names if n.endswith("mla_cache"))
        assert state.values[cache].shape[:2] == (B, T)
    assert len(tb._COMPILED) == before


@pytest.mark.parametrize("quant", ["mxfp4", "int4"])
def test_grouped_matmul_dequantises_packed_experts(quant, rng):
    """The gather-GEMM kernel on packed experts equals k3.grouped_matmul's float64 reference."""
    from k3ir.backends.tvm import kernels
    from tvm import relax

    from k3ir import quant as q
    from k3ir.ops.moe import GroupedMatmul
    E, N, K, R = 3, 8, 64, 10
    w = rng.normal(size=(E, N, K))
    packed, scales = q.mxfp4_quantize(w) if quant == "mxfp4" else q.int4_quantize(w.astype(np.float32))
    x = rng.normal(size=(R, K)).astype(np.float32)
    offsets = np.array([0, 4, 4, R], dtype=np.int64)                     # expert 1 gets no rows
    want = GroupedMatmul({"quant": quant}).reference(x, offsets, packed, scales)
    bb = relax.BlockBuilder()
    sc_dt = "uint8" if quant == "mxfp4" else "float32"
    args = [relax.Var("x", relax.TensorType([R, K], "float32")), relax.Var("o", relax.TensorType([E + 1], "int64")),
            relax.Var("w", relax.TensorType(list(packed.shape), str(packed.dtype))),
            relax.Var("s", relax.TensorType(list(scales.shape), sc_dt))]
    with bb.function("main", args):
        with bb.dataflow():
            y = bb.emit_output(bb.emit_te(kernels.grouped_matmul, *args, quant))
        bb.emit_func_output(y)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, offsets, packed, scales.astype(sc_dt))]).numpy()
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("quant", ["mxfp4", "int4"])
@pytest.mark.parametrize("E,N,K", [(5, 6, 64), (3, 36, 96)])
def test_scheduled_quantised_grouped_gemm_equals_the_reference(quant, E, N, K, rng):
    """kernels.grouped_quant_kernel (dequantisation fused into the register tile) against k3.grouped_matmul's
    float64 reference on packed experts: experts with 0, 1, 2, 3, 4 and 7 rows (around the MT-row tile), N not a
    multiple of the 8- or 4-row blocks."""
    from k3ir.backends.tvm import kernels

    from k3ir import quant as q
    from k3ir.ops.moe import GroupedMatmul
    fn = tvm.compile(tvm.IRModule({"main": kernels.grouped_quant_kernel(E, N, K, quant).with_attr(
        "global_symbol", "main")}), target="llvm")["main"]
    w = rng.normal(size=(E, N, K))
    packed, scales = q.mxfp4_quantize(w) if quant == "mxfp4" else q.int4_quantize(w.astype(np.float32))
    scales = scales if quant == "mxfp4" else scales.astype(np.float32)
    for rows in ([0, 1, 3, 0, 7][:E], [4, 0, 2, 1, 3][:E]):
        off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        x = rng.normal(size=(int(off[-1]), K)).astype(np.float32)
        want = GroupedMatmul({"quant": quant}).reference(x, off, packed, scales)
        y = tvm.runtime.tensor(np.zeros((len(x), N), np.float32))
        fn(*[tvm.runtime.tensor(a) for a in (x, off, packed, scales)], y)
        assert rel_err(y.numpy(), want) < 1e-6, rows


def test_packed_experts_lower_to_the_scheduled_kernel():
    """k3-tiny mxfp4 on the tvm target: every packed grouped GEMM is the scheduled ``grouped_quant`` kernel, none
    the unscheduled TE gather-GEMM; for tvm-cuda the same call is the hand-scheduled GPU kernel."""
    from k3ir.backends.tvm import gpu
    from k3ir.backends.tvm.lower import build_relax
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = load_tiny("k3-tiny")
    run_pipeline(m, pipeline_for("tvm"), quantize="mxfp4")
    names = [gv.name_hint for gv in build_relax(m, ["prefill", "decode"])[0].functions]
    assert any(n.startswith("grouped_quant_") and n.endswith("_mxfp4") for n in names)
    assert not any(n.startswith("grouped_matmul_mxfp4") for n in names)
    gpu_names = [gv.name_hint for gv in gpu.lower_gpu(m, ["decode"])[0].functions]
    assert any(n.startswith("grouped_gemm_gpu_") and n.endswith("_mxfp4") for n in gpu_names)
    assert not any(n.startswith(("grouped_quant", "grouped_matmul_mxfp4")) for n in gpu_names)


@pytest.mark.parametrize("N,K", [(36, 64), (6, 20)])
def test_tiled_linear_kernels_cover_tails(N, K, rng):
    """kernels.linear_kernel / grouped_linear_kernel against NumPy (float64) for row counts around the MT-row
    tile (1, 2, 3, 4, 7 rows; experts with 0, 1 or several rows) and weights whose N is not a multiple of the
    8- or 4-row blocks and whose K takes 4 lanes."""
    from k3ir.backends.tvm import kernels

    def build(f):
        return tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")["main"]
    lin, E = build(kernels.linear_kernel(N, K)), 5
    w = rng.normal(size=(N, K))
    for M in (1, 2, 3, 4, 7):
        x = rng.normal(size=(M, K))
        y = tvm.runtime.tensor(np.zeros((M, N), np.float32))
        lin(tvm.runtime.tensor(x.astype(np.float32)), tvm.runtime.tensor(w.astype(np.float32)), y)
        assert rel_err(y.numpy(), x @ w.T) < 1e-5, M
    grp = build(kernels.grouped_linear_kernel(E, N, K))
    we = rng.normal(size=(E, N, K))
    for ids in ([3], [0, 0, 2, 2, 2, 2, 4, 4, 4]):
        ids = np.array(ids)
        off = np.searchsorted(ids, np.arange(E + 1)).astype(np.int64)
        x = rng.normal(size=(len(ids), K))
        y = tvm.runtime.tensor(np.zeros((len(ids), N), np.float32))
        grp(*[tvm.runtime.tensor(a) for a in (x.astype(np.float32), off, we.reshape(E * N, K).astype(np.float32))], y)
        assert rel_err(y.numpy(), np.einsum("rk,rnk->rn", x, we[ids])) < 1e-5, ids


@pytest.mark.parametrize("Hk", [1, 2])
def test_attention_kernel_masks_causally_and_by_cache_length(Hk, rng):
    """kernels.attention_kernel against a float64 NumPy softmax attention with k3.causal_mask's rule (keep key s when
    s <= t + S - T and (s < lengths[b] or s >= S - T)): per-head keys (Hk = H) and one shared latent (Hk = 1)."""
    from k3ir.backends.tvm import kernels
    B, T, S, H, D, P, Dv, scale = 2, 3, 7, 2, 16, 8, 12, 0.3
    q, qr = rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, H, P))
    k, kr, v = rng.normal(size=(B, S, Hk, D)), rng.normal(size=(B, S, P)), rng.normal(size=(B, S, Hk, Dv))
    lengths = np.array([4, 2], dtype=np.int64)                        # row 1: cache slots 2, 3 are padding
    want = np.zeros((B, T, H, Dv))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                keep = [s for s in range(S) if s <= t + S - T and (s < lengths[b] or s >= S - T)]
                sc = np.array([scale * (q[b, t, h] @ k[b, s, h % Hk] + qr[b, t, h] @ kr[b, s]) for s in keep])
                a = np.exp(sc - sc.max())
                want[b, t, h] = (a / a.sum()) @ v[b, keep, h % Hk]
    f = kernels.attention_kernel(H, Hk, D, P, Dv, scale, "float32").with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    args = [tvm.runtime.tensor(a.astype(np.float32)) for a in (q, qr, k, kr, v)] + [tvm.runtime.tensor(lengths)]
    out = tvm.runtime.tensor(np.zeros((B, T, H, Dv), np.float32))
    lib["main"](*args, out)
    assert rel_err(out.numpy(), want) < 1e-5


def test_cross_targets_emit_device_code():
    from k3ir.backends import get_backend
    from k3ir.backends.tvm.cross import emit_source
    expect = {"cuda": "__global__", "metal": "kernel void", "opencl": "__kernel", "webgpu": "@compute"}
    for kind, marker in expect.items():
        src = emit_source(kind)
        assert marker in src and "k3_linear_silu" in src, kind
    with pytest.raises(K3BackendError, match="tvm-vulkan"):
        emit_source("vulkan")
    assert "vulkan-spirv" in get_backend("tvm-vulkan").available()


def test_states_pass_between_steps_without_a_copy():
    """``run`` returns views of the VM's results and takes a 64-byte aligned contiguous array back without copying
    it (the decode state each step); an unaligned or read-only array is copied, with the same values."""
    from k3ir.backends.tvm import _tvm_tensor
    m = load_tiny("kimi-linear-tiny")
    exe = k3ir.compile(m, target="tvm", dtype="float32")
    sess = Session(exe)
    logits, state = sess.prefill(token_ids(m.attrs["vocab_size"], 1, 5))
    for name in state.names:
        a = state.values[name]
        assert a.ctypes.data % 64 == 0, name
        assert np.shares_memory(np.from_dlpack(_tvm_tensor(a)), a), name
    base = np.arange(17, dtype=np.float32)
    for a in (base[1:], np.arange(16, dtype=np.float32)[::2]):
        t = _tvm_tensor(a)
        assert not np.shares_memory(np.from_dlpack(t), a) and np.array_equal(t.numpy(), a)
    frozen = np.zeros(16, np.float32)
    frozen.flags.writeable = False
    assert np.array_equal(_tvm_tensor(frozen).numpy(), frozen)
    nxt, _ = sess.decode(logits[:, -1:].argmax(-1), state)
    assert bool(nxt.isfinite().all())
