# ruff: noqa: B023, BLE001, F821
"""The K3 MoE layer (896 experts, top-16, latent 3584, intermediate 3072, SiTU-GLU).

Run alone, the same-run comparison: our routed-expert block (``moe.moe_forward``: GLU GEMM with SiTU fused, down
GEMM with the combine weight fused, per-token sum) against ``torch._grouped_mm`` on the same expert-sorted rows,
GEMM only (gate, up, down) and GEMM + eager SiTU + combine, in bf16 at 8192 and 256 tokens; copy bandwidth and bf16
matmul rate measured first; ``--repeats`` interleaved medians; table last, JSON to ``--out``::

    python3 bench/bench_moe_layer.py          # JSON to bench/results/bench_moe_layer/<date>-<commit>.json
    TRITON_INTERPRET=1 python3 bench/bench_moe_layer.py --tiny --out /tmp/moe.json     # CPU smoke test

``section_moe`` is the older ``bench/bench_models.py --sections moe`` (config sweep, MXFP4 experts)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import HBM, MM, bench, rel, result_path, row, sort_by_expert


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



def compare(tiny: bool, out: str, repeats: int = 3) -> dict:
    """The same-run comparison of the module docstring; ``tiny``: 8 experts, D = I = 64, top-2, 16 and 64 tokens in
    float32 (the CPU interpreter). Returns the report's data (``benchlib.Report``)."""
    from benchlib import Report, fmt_ms, interleaved, print_table
    from k3ir.backends.triton import moe
    dev, dt = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    E, D, I, k = (8, 64, 64, 2) if tiny else (896, 3584, 3072, 16)
    rep = Report("moe_layer", out, sys.argv)
    rep.ceilings()
    gen = torch.Generator(device=dev).manual_seed(0)
    w1, w3 = (torch.randn(E, I, D, device=dev, dtype=dt, generator=gen).mul_(0.02) for _ in range(2))
    w2 = torch.randn(E, D, I, device=dev, dtype=dt, generator=gen).mul_(0.02)
    w1t, w3t, w2t = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)
    for T in ((64, 16) if tiny else (8192, 256)):
        logits = torch.randn(T, E, device=dev, generator=gen)
        wts, idx = torch.topk(torch.sigmoid(logits), k, dim=-1)
        order, inv, cnt, off = sort_by_expert(idx, E)
        xs = torch.randn(T, D, device=dev, dtype=dt, generator=gen)[order // k].contiguous()
        cw = wts.reshape(-1)[order].float()
        inv3 = inv.reshape(1, T, k)
        offs32 = cnt.cumsum(0).to(torch.int32)
        h_in = torch.randn(T * k, I, device=dev, dtype=dt, generator=gen)

        def ours(xs=xs, off=off, cw=cw, inv3=inv3):
            return moe.moe_forward(xs, off, w1, w3, w2, cw, inv3, "none", act="situ")

        def gemm_only(xs=xs, offs32=offs32, h_in=h_in):
            torch._grouped_mm(xs, w1t, offs=offs32)
            torch._grouped_mm(xs, w3t, offs=offs32)
            return torch._grouped_mm(h_in, w2t, offs=offs32)

        def gemm_eager(xs=xs, offs32=offs32, cw=cw, inv3=inv3):
            g = torch._grouped_mm(xs, w1t, offs=offs32)
            u = torch._grouped_mm(xs, w3t, offs=offs32)
            h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
            y = torch._grouped_mm(h, w2t, offs=offs32) * cw[:, None].to(dt)
            return y[inv3].float().sum(-2).to(dt)
        a, b = ours(), gemm_eager()
        r = {"tokens": T, "experts": E, "top_k": k, "hidden": D, "intermediate": I, "dtype": str(dt)[6:],
             "experts_used": int((cnt > 0).sum()), "err_ours_vs_grouped_mm": rel(a, b),
             "err_grouped_mm_vs_ours": rel(b, a), "ours_finite": bool(torch.isfinite(a).all())}
        del a, b
        t0 = time.time()
        t = interleaved({"ours": ours, "gemm_only": gemm_only, "gemm_eager": gemm_eager}, repeats, rep_ms=300)
        wbytes = 3 * I * D * r["experts_used"] * (2 if dt == torch.bfloat16 else 4)
        flops = 2 * T * k * 3 * I * D
        med = t["ours"]["median"] * 1e-3
        r.update(ours_ms=t["ours"], grouped_mm_gemm_only_ms=t["gemm_only"], grouped_mm_eager_ms=t["gemm_eager"],
                 ratio_gemm_only_over_ours=t["gemm_only"]["median"] / t["ours"]["median"],
                 ratio_eager_over_ours=t["gemm_eager"]["median"] / t["ours"]["median"],
                 weight_bytes=wbytes, flops=flops, floor_ms=max(wbytes / rep.copy_Bps, flops / rep.bf16_flops) * 1e3,
                 ours_weight_bw_frac=wbytes / rep.copy_Bps / med, ours_flop_frac=flops / rep.bf16_flops / med,
                 gemm_only_weight_bw_frac=wbytes / rep.copy_Bps / (t["gemm_only"]["median"] * 1e-3),
                 gemm_only_flop_frac=flops / rep.bf16_flops / (t["gemm_only"]["median"] * 1e-3),
                 timing_s=time.time() - t0)
        rep.add(r)
        del xs, h_in
    m = rep.data["meta"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['commit']}, {m['date']}; K3IR_* "
          f"switches: {m['env_switches'] or 'none'}")
    print_table(["tokens", "ours ms (min-max)", "_grouped_mm GEMM only", "GEMM+eager SiTU+combine", "GEMM-only/ours",
                 "eager/ours", "ours bytes %", "ours flop %", "err vs eager"],
                [[r["tokens"], fmt_ms(r["ours_ms"]), fmt_ms(r["grouped_mm_gemm_only_ms"]),
                  fmt_ms(r["grouped_mm_eager_ms"]), f"{r['ratio_gemm_only_over_ours']:.3f}",
                  f"{r['ratio_eager_over_ours']:.3f}", f"{r['ours_weight_bw_frac']:.1%}", f"{r['ours_flop_frac']:.1%}",
                  f"{r['err_ours_vs_grouped_mm']:.1e}"] for r in rep.data["rows"]])
    return rep.data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/bench_moe_layer/<date>-<commit>.json)")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    compare(a.tiny, a.out or result_path("bench_moe_layer"), a.repeats)


if __name__ == "__main__":
    main()
