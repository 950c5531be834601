"""Where the time goes on the GPU (issues 5 and 6): registers and spills of every compiled Triton
kernel of the triton target, and a kernel-time profile of one decode step of a model.

    python3 bench/gpu_diag.py [--sections regs,decode] [--model kimi-linear-6p6b] [--batch 1]

``regs``: runs the KDA forward (K3 gate and softplus, B1 T4096 H32 D128), the MoE grouped GEMMs
(bf16 and MXFP4, K3 expert shape, 16 experts) and MLA kernels once, then lists every compiled
kernel with its registers per thread, spilled bytes, shared memory and warps (a kernel that
spills is the first suspect when it runs far below both ceilings).
``decode``: a model with random weights, a 512-token prefill, then one decode step under
``torch.profiler`` run eagerly (kernel table, top 25 by GPU time) and the CUDA-graph step time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))


def compiled_kernels(mod):
    """(kernel name, CompiledKernel) for every Triton JIT function in ``mod`` compiled so far."""
    import triton
    out = []
    for name in dir(mod):
        fn = getattr(mod, name)
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        caches = getattr(fn, "device_caches", None)
        if caches:
            for dev in caches.values():
                for ck in dev[0].values():
                    out.append((name, ck))
        else:
            for dev in getattr(fn, "cache", {}).values():
                for ck in dev.values():
                    out.append((name, ck))
    return out


def section_regs():
    from k3ir.backends.triton import kda, kda_kernels, layer_kernels, mla, moe, norm
    dev = "cuda"
    B, T, H, D = 1, 4096, 32, 128
    g = torch.Generator(device=dev).manual_seed(0)
    x = [torch.randn(B, T, H, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(4)]
    beta = torch.randn(B, T, H, device=dev, generator=g).to(torch.bfloat16)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=g))
    dt = torch.randn(H * D, device=dev, generator=g) * 0.1
    for lb in (-5.0, None):
        kda.kda_forward(*x, beta, A_log, dt, lower_bound=lb, output_final_state=True)
    E, I, Dm, R = 16, 3072, 3584, 256
    counts = torch.full((E,), R // E, device=dev)
    off = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    xs = torch.randn(R, Dm, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(E, I, Dm, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, Dm, I, device=dev, dtype=torch.bfloat16) * 0.02
    h = moe.grouped_matmul(xs, off, w1, None, "none", w3=w1, act="situ")
    moe.grouped_matmul(h, off, w2, None, "none", row_scale=torch.rand(R, device=dev))
    p1 = torch.randint(0, 256, (E, I, Dm // 2), device=dev, dtype=torch.uint8)
    s1 = torch.randint(118, 123, (E, I, Dm // 32), device=dev, dtype=torch.uint8)
    moe.grouped_matmul(xs, off, p1, s1, "mxfp4", w3=p1, scales3=s1, act="situ")
    torch.cuda.synchronize()
    print(f"\n{'kernel':<28} {'regs':>5} {'spill B':>8} {'smem B':>8} {'warps':>5} {'stages':>6}")
    for mod in (kda_kernels, layer_kernels, moe, mla, norm):
        for name, ck in compiled_kernels(mod):
            md = ck.metadata
            print(f"{name:<28} {getattr(ck, 'n_regs', -1):>5} {getattr(ck, 'n_spills', -1):>8} "
                  f"{getattr(md, 'shared', -1):>8} {getattr(md, 'num_warps', -1):>5} {getattr(md, 'num_stages', -1):>6}")


def section_decode(model, batch):
    from bench_models import gpu_params
    from k3ir.runtime import Session

    import k3ir
    m = k3ir.load(model)
    exe = k3ir.compile(m, target="triton", dtype="bfloat16", device="cuda")
    sess = Session(exe, params=gpu_params(exe.module))
    ids = np.random.default_rng(0).integers(3, 1000, (batch, 512))
    _, st = sess.prefill(ids)
    nxt = np.full((batch, 1), 7)
    exe.cuda_graphs = False
    for _ in range(2):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, st = sess.decode(nxt, st)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    t = time.perf_counter()
    for _ in range(5):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    print(f"eager decode step: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms")
    exe.cuda_graphs = True
    for _ in range(2):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        _, st = sess.decode(nxt, st)
    torch.cuda.synchronize()
    print(f"graph decode step (Session.decode, incl. host): {(time.perf_counter() - t) / 10 * 1e3:.2f} ms")
    gd = exe._graph
    if gd is not None and gd.graph is not None:
        gd.graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            gd.graph.replay()
        torch.cuda.synchronize()
        print(f"graph replay alone: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="regs,decode")
    ap.add_argument("--model", default="kimi-linear-6p6b")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    for s in a.sections.split(","):
        print(f"==== {s}", flush=True)
        try:
            section_regs() if s == "regs" else section_decode(a.model, a.batch)
        except Exception:  # noqa: BLE001 - a diagnostic: print and go on to the next section
            import traceback
            traceback.print_exc()


if __name__ == "__main__":
    main()
