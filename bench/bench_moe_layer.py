# ruff: noqa: B023, BLE001, F821
"""The K3 MoE layer section of ``bench/bench_models.py`` (``--sections moe``): our Triton grouped
GEMMs against ``torch._grouped_mm`` (bf16) and MXFP4 experts against their weight-bytes floor.
Run it through ``python3 bench/bench_models.py --sections moe [--smoke]``."""
from __future__ import annotations

import torch
from benchlib import HBM, MM, bench, rel, row, sort_by_expert


def section_moe(smoke, dev="cpu", dt=torch.float32):
    """One K3 MoE layer (896 experts, D 3584, I 3072, top-16; ``smoke``: 8 experts at 64): our grouped
    GEMMs (bf16, SiTU-GLU) against ``torch._grouped_mm`` at 256 and 8192 tokens with a config sweep,
    then MXFP4 experts against the weight-bytes floor. Rows go to ``benchlib.row`` (section "moe")."""
    from k3ir.backends.triton import moe
    E, D, I, k = (8, 64, 64, 2) if smoke else (896, 3584, 3072, 16)
    toks = (16, 64) if smoke else (256, 8192)
    w1 = torch.randn(E, I, D, device=dev, dtype=dt) * 0.02
    w3 = torch.randn(E, I, D, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(E, D, I, device=dev, dtype=dt) * 0.02
    wbytes = 3 * E * I * D
    for T in toks:
        logits = torch.randn(T, E, device=dev)
        wts, idx = torch.topk(torch.sigmoid(logits), k, dim=-1)
        order, inv, cnt, off = sort_by_expert(idx, E)
        x = torch.randn(T, D, device=dev, dtype=dt)
        xs = x[order // k]
        cw = wts.reshape(-1)[order].float()
        inv3 = inv.reshape(1, T, k)
        offs32 = cnt.cumsum(0).to(torch.int32)
        used = int((cnt > 0).sum())
        flops = 2 * T * k * 3 * I * D
        floor = max(wbytes * 2 * used / E / HBM, flops / MM) * 1e3

        def ours():
            return moe.moe_forward(xs, off, w1, w3, w2, cw, inv3, "none", act="situ")

        def theirs():
            g = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs32)
            u = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs32)
            h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
            y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs32) * cw[:, None].to(dt)
            return y[inv3].float().sum(-2).to(dt)
        a = ours()
        b = theirs()
        t_o, t_t = bench(ours), bench(theirs)
        if T == toks[-1] and not smoke:
            for cg, cd in (((128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 3)), ((64, 128, 64, 1, 4, 4), (64, 256, 64, 1, 8, 3)),
                           ((128, 64, 64, 1, 4, 4), (128, 128, 64, 1, 4, 4)), ((256, 64, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3))):
                try:
                    tt = bench(lambda: moe.moe_forward(xs, off, w1, w3, w2, cw, inv3, "none", act="situ", configs=(cg, cd)))
                    row("moe", f"sweep bf16 T={T} glu{cg[:3]}w{cg[4]} down{cd[:3]}w{cd[4]}", ms=tt)
                except Exception as e:
                    row("moe", f"sweep bf16 T={T} {cg} {cd}", error=repr(e)[:200])
        row("moe", f"K3 MoE layer bf16 T={T}", ms=t_o, grouped_mm_ms=t_t, speedup=t_t / t_o, floor_ms=floor,
            rel_err_vs_grouped_mm=rel(a, b), experts_used=used)
    del w1, w3, w2
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    p = [torch.randint(0, 256, s, device=dev, dtype=torch.uint8) for s in ((E, I, D // 2), (E, I, D // 2),
                                                                              (E, D, I // 2))]
    sc = [torch.randint(118, 123, s, device=dev, dtype=torch.uint8) for s in ((E, I, D // 32), (E, I, D // 32),
                                                                              (E, D, I // 32))]
    from k3ir.backends.triton import moe_layout
    for j in range(3):          # the device layout the triton executable prepares (in place: one copy)
        p[j], sc[j] = moe_layout.prepare(p[j], sc[j])
    for T in toks:
        idx = torch.topk(torch.randn(T, E, device=dev), k, dim=-1).indices
        order, inv, cnt, off = sort_by_expert(idx, E)
        xs = torch.randn(T, D, device=dev, dtype=dt)[order // k]
        cw = torch.rand(T * k, device=dev)
        used = int((cnt > 0).sum())
        fb = wbytes * (0.5 + 1 / 32) * used / E
        t = bench(lambda: moe.moe_forward(xs, off, p[0], p[1], p[2], cw, inv.reshape(1, T, k), "mxfp4",
                                          (sc[0], sc[1], sc[2]), act="situ"))
        if T == toks[0] and not smoke:
            for cg in ((16, 128, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 32, 128, 1, 2, 4), (16, 128, 256, 1, 8, 3)):
                try:
                    tt = bench(lambda: moe.moe_forward(xs, off, p[0], p[1], p[2], cw, inv.reshape(1, T, k), "mxfp4",
                                                       (sc[0], sc[1], sc[2]), act="situ", configs=(cg, cg)))
                    row("moe", f"sweep MXFP4 T={T} {cg[:3]}w{cg[4]}s{cg[5]}", ms=tt)
                except Exception as e:
                    row("moe", f"sweep MXFP4 T={T} {cg}", error=repr(e)[:200])
        row("moe", f"K3 MoE layer MXFP4 T={T}", ms=t, floor_ms=max(fb / HBM, 2 * T * k * 3 * I * D / MM) * 1e3,
            weight_GBps=fb / t / 1e6)

