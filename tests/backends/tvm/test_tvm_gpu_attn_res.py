"""The AttnRes kernel of the TVM GPU kinds (backends/tvm/gpu_attn_res.py): its phases with the threads of a block
run in turn (``emulate=True``, built for llvm) against k3.attn_res_fused's float64 reference (SPEC.md 2), and the
GPU form built for the kinds whose toolchain is here."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")

from conftest import rel_err
from helpers import gpu_kind_or_skip


@pytest.mark.parametrize("n_blocks,slots,d", [(1, 1, 24), (3, 4, 200), (9, 9, 130)])
def test_gpu_attn_res_phases_with_threads_in_turn_equal_the_reference(n_blocks, slots, d, rng):
    """One snapshot (two sources), a buffer with an unused slot, K3's nine snapshots; d under one thread's stride
    (24), over it with a ragged tail (200, 130 = 128 + 2); sources of different scales and a nonzero pseudo-query,
    so the softmax is far from uniform. Within 1e-5 of the float64 reference (SPEC.md 11)."""
    import tvm
    from k3ir.backends.tvm.gpu_attn_res import attn_res_gpu

    from k3ir.ops.residual import AttnResFused
    B, L, eps = 2, 3, 1e-6
    fn = tvm.compile(tvm.IRModule({"main": attn_res_gpu(n_blocks, slots, d, eps, emulate=True).with_attr(
        "global_symbol", "main")}), target="llvm")["main"]
    w, r = rng.normal(size=(d,)) * 2.0, rng.uniform(0.5, 1.5, size=(d,))
    buf = rng.normal(size=(B, L, slots, d)) * rng.uniform(0.1, 10.0, size=(1, 1, slots, 1))
    pref = rng.normal(size=(B, L, d)) * 3.0
    want = AttnResFused({"n_blocks": n_blocks, "eps": eps}).reference(w.reshape(1, d), r, buf, pref)
    out = tvm.runtime.tensor(np.zeros((B, L, d), np.float32))
    fn(*[tvm.runtime.tensor(a.astype(np.float32)) for a in (w, r, buf, pref)], out)
    assert rel_err(out.numpy(), want) < 1e-5


def test_gpu_attn_res_rejects_more_blocks_than_slots():
    from k3ir.backends.tvm.gpu_attn_res import attn_res_gpu
    with pytest.raises(ValueError, match="n_blocks 3 not within 1..2"):
        attn_res_gpu(3, 2, 16, 1e-6)


@pytest.mark.parametrize("kind", ["cuda", "rocm", "metal", "opencl"])
def test_gpu_attn_res_kernel_builds_for_the_gpu_kinds(kind, monkeypatch):
    """The GPU form (one block per token, a barrier between the partial sums and their row sums) builds for ``kind``
    at K3's width (d = 7168, nine snapshots) (rocm: gfx942); for cuda nvcc compiles it to sm_90a and sm_80 code."""
    gpu_kind_or_skip(kind, monkeypatch)
    import tvm
    from k3ir.backends.tvm import cubin
    from k3ir.backends.tvm.gpu import gpu_target
    from k3ir.backends.tvm.gpu_attn_res import attn_res_gpu
    lib = tvm.compile(tvm.IRModule({"attn_res": attn_res_gpu(9, 9, 7168, 1e-6).with_attr("global_symbol", "attn_res")}),
                      target=gpu_target(kind))
    [dev] = [m for m in lib.mod.imports if m.kind == {"rocm": "hip"}.get(kind, kind)]
    src = dev.inspect_source("asm") if kind == "rocm" else dev.inspect_source()
    assert "attn_res_kernel" in src
    if kind == "cuda":
        fat = cubin.compile_fatbin(src)
        tool = cubin.find_cuobjdump()
        if tool is not None and cubin.find_nvdisasm() is not None:
            sass = cubin.cuobjdump_functions(fat, tool)
            assert sass["sm_90a"] == {"attn_res_kernel"} == sass["sm_80"]
