"""The chunked KDA prefill of the TVM GPU kinds (backends/tvm/gpu_kda.py): its launches with the threads of a block
run in turn (``emulate=True``, built for llvm) against the float64 token recurrence of SPEC.md 3.5, and the GPU
form built for the kinds whose toolchain is here."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")

from conftest import rel_err
from helpers import gpu_kind_or_skip


def kda_reference(q, k, v, g, beta, s0):
    """SPEC.md 3.5 token by token in float64: S = Diag(exp(g_t)) S; u = S^T k_t; S += beta_t k_t (v_t - u)^T;
    o_t = S^T q_t (q pre-scaled). Shapes [B,T,H,*], s0 [B,H,K,V]; returns (o, S)."""
    S = s0.astype(np.float64).copy()
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None]
        u = np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - u)[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def kda_inputs(rng, B, T, H, K, V, gate):
    """q (pre-scaled), k L2-normalised per head as the layer feeds them; g: the K3 lower-bounded gate in [-5, 0]
    or Kimi Linear's unbounded -a softplus(z) (down to about -30 here); beta in (0, 1); a nonzero state."""
    q = rng.normal(size=(B, T, H, K)) * K ** -0.5
    k = rng.normal(size=(B, T, H, K))
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.normal(size=(B, T, H, V))
    z = rng.normal(size=(B, T, H, K)) * 2.0
    g = -5.0 / (1.0 + np.exp(-z)) if gate == "lower_bound" else -3.0 * np.log1p(np.exp(z + 1.0))
    beta = rng.uniform(0.05, 1.0, size=(B, T, H))
    s0 = rng.normal(size=(B, H, K, V)) * 0.5
    return q, k, v, g, beta, s0


def _run(fn, args, B, T, H, K, V, C):
    import tvm
    outs = [np.zeros(s, np.float32) for s in ((B, T, H, V), (B, H, K, V), (B, T, H, K), (B, T, H, 2 * K), (B, T, H, K),
                                               (B, T, H, V), (B, T, H, C))]      # o, s, gpu_kda.WORKSPACES
    ts = [tvm.runtime.tensor(x) for x in outs]
    fn(*[tvm.runtime.tensor(a.astype(np.float32)) for a in args], *ts)
    return ts[0].numpy(), ts[1].numpy()


@pytest.mark.parametrize("T,C,min_tokens,gate", [
    (37, 16, 0, "lower_bound"),        # two full chunks and a partial one
    (37, 16, 0, "softplus"),           # unbounded gates: decays far below exp(-5) per token
    (16, 16, 0, "lower_bound"),        # exactly one chunk
    (1, 16, 0, "softplus"),            # one token through the chunked path
    (70, 64, 64, "lower_bound"),       # the default chunk size, a partial second chunk
    (5, 16, 8, "lower_bound"),         # shorter than min_tokens: the token recurrence
])
def test_gpu_kda_chunk_phases_with_threads_in_turn_equal_the_recurrence(T, C, min_tokens, gate, rng):
    """``gpu_kda.kda_chunk_gpu(..., emulate=True)``: the gcum, intra (A, P, forward substitution for W and U) and
    inter (V', O, the state across chunks) launches with a block's threads in turn, built for llvm, equal the
    float64 token recurrence (SPEC.md 3.5) from a nonzero initial state within 1e-5 (SPEC.md 11), outputs and the
    state out; K over one shared-memory tile with a ragged tail (20 = 16 + 4), V over two column blocks with a
    ragged tail (40 = 32 + 8)."""
    import tvm
    from k3ir.backends.tvm.gpu_kda import kda_chunk_gpu
    B, H, K, V = 2, 2, 20, 40
    f = kda_chunk_gpu(H, K, V, C=C, min_tokens=min_tokens, emulate=True)
    fn = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")["main"]
    args = kda_inputs(rng, B, T, H, K, V, gate)
    o, s = _run(fn, args, B, T, H, K, V, C)
    want_o, want_s = kda_reference(*args)
    assert rel_err(o, want_o) < 1e-5 and rel_err(s, want_s) < 1e-5, (rel_err(o, want_o), rel_err(s, want_s))


def test_gpu_kda_chunk_state_carries_across_calls(rng):
    """A prompt in two calls (30 then 21 tokens, the state out of the first passed in) equals one 51-token call and
    the float64 recurrence: chunk boundaries fall at different tokens in the two splits."""
    import tvm
    from k3ir.backends.tvm.gpu_kda import kda_chunk_gpu
    B, H, K, V, C = 1, 2, 16, 16, 16
    fn = tvm.compile(tvm.IRModule({"main": kda_chunk_gpu(H, K, V, C=C, min_tokens=0, emulate=True).with_attr(
        "global_symbol", "main")}), target="llvm")["main"]
    q, k, v, g, beta, s0 = kda_inputs(rng, B, 51, H, K, V, "lower_bound")
    o1, s1 = _run(fn, (q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30], s0), B, 30, H, K, V, C)
    o2, s2 = _run(fn, (q[:, 30:], k[:, 30:], v[:, 30:], g[:, 30:], beta[:, 30:], s1), B, 21, H, K, V, C)
    want_o, want_s = kda_reference(q, k, v, g, beta, s0)
    assert rel_err(np.concatenate([o1, o2], axis=1), want_o) < 1e-5 and rel_err(s2, want_s) < 1e-5


@pytest.mark.parametrize("kind,want", [("cuda", (64, 32)), ("metal", (64, 32)), ("webgpu", (32, 16))])
def test_gpu_kda_chunk_shape_fits_the_kinds_shared_memory(kind, want):
    """K = V = 128 (Kimi Linear, K3): the default chunk of 64 and 32 value columns per block where 32 KiB or more is
    there (24 + 28 KiB declared), chunks of 32 and 16 columns within WebGPU's default 16 KiB."""
    from k3ir.backends.tvm.gpu import SHARED_BYTES
    from k3ir.backends.tvm.gpu_kda import chunk_shape, shared_bytes
    C, TV = chunk_shape(128, 128, 64, SHARED_BYTES[kind])
    assert (C, TV) == want and max(shared_bytes(128, 128, C, TV).values()) <= SHARED_BYTES[kind]


def test_gpu_kda_chunk_rejects_a_chunk_size_the_thread_groups_do_not_divide():
    from k3ir.backends.tvm.gpu_kda import kda_chunk_gpu
    with pytest.raises(ValueError, match="chunk size 20"):
        kda_chunk_gpu(2, 16, 16, C=20)


@pytest.mark.parametrize("kind", ["cuda", pytest.param("rocm", marks=pytest.mark.slow), "metal", "opencl"])
def test_gpu_kda_chunk_kernel_builds_for_the_gpu_kinds(kind, monkeypatch):
    """The GPU form (thread bindings, shared memory, the host branch on the prompt length) at K = V = 128 and the
    default chunk of 64 builds for ``kind`` (rocm: gfx942, 24 s here, so ``slow``): four device functions (gcum,
    intra, inter, the recurrence), within 32 KiB of shared memory per block; for cuda, nvcc compiles the generated
    source to sm_90a and sm_80 code that holds all four (cuobjdump)."""
    gpu_kind_or_skip(kind, monkeypatch)
    import tvm
    from k3ir.backends.tvm import cubin
    from k3ir.backends.tvm.gpu import device_function_names, gpu_target
    from k3ir.backends.tvm.gpu_kda import kda_chunk_gpu, shared_bytes
    assert max(shared_bytes(128, 128, 64, 32).values()) <= 32 * 1024
    lib = tvm.compile(tvm.IRModule({"kda_chunk": kda_chunk_gpu(4, 128, 128).with_attr("global_symbol", "kda_chunk")}),
                      target=gpu_target(kind))
    [dev] = [m for m in lib.mod.imports if m.kind == {"rocm": "hip"}.get(kind, kind)]
    names = device_function_names(dev) or []
    src = dev.inspect_source("asm") if kind == "rocm" else dev.inspect_source()
    if kind != "cuda":
        assert src.count("kda_chunk_kernel") >= 4
        return
    assert len(names) == 4, names
    tool = cubin.find_cuobjdump()
    fat = cubin.compile_fatbin(src)
    if tool is not None and cubin.find_nvdisasm() is not None:
        sass = cubin.cuobjdump_functions(fat, tool)
        assert sass["sm_90a"] == set(names) == sass["sm_80"]


@pytest.mark.slow
def test_gpu_lowering_runs_the_chunked_prefill_like_torch(tmp_path):
    """kimi-linear-tiny through the GPU kinds' lowering compiled for llvm with the hand-written kernels' emulated forms
    (``helpers.gpu_lowered_cpu_artifact``) and ``TvmConfig(kda_chunk_size=8, kda_chunk_min_tokens=0)``: a 19-token
    prefill runs the chunked kernels (two chunks and a partial one, state from zero), a decode step the recurrence on
    the state it left; logits within 1e-5 of the torch target in float32 on the same weights."""
    from _tiny_models import load_tiny, token_ids
    from helpers import gpu_lowered_cpu_artifact
    from k3ir.backends.tvm.config import tvm_config
    from k3ir.runtime import Session

    import k3ir
    art = str(tmp_path / "art")
    with tvm_config(kda_chunk_size=8, kda_chunk_min_tokens=0):
        params = gpu_lowered_cpu_artifact("kimi-linear-tiny", art, dtype="float32")
    text = next((tmp_path / "art").glob("*.so")).read_bytes()
    assert b"kda_chunk_" in text                       # the chunked kernel is in the library
    m = load_tiny("kimi-linear-tiny")
    ids = token_ids(m.attrs["vocab_size"], 1, 19)
    sess = Session.load(art)
    lo, st = sess.prefill(ids)
    lo2, _ = sess.decode(ids[:, -1:], st)
    ref = Session(k3ir.compile(load_tiny("kimi-linear-tiny"), target="torch", dtype="float32"), params=params)
    want, st_ref = ref.prefill(ids)
    want2, _ = ref.decode(ids[:, -1:], st_ref)
    assert rel_err(lo, want) < 1e-5 and rel_err(lo2, want2) < 1e-5, (rel_err(lo, want), rel_err(lo2, want2))
