# ruff: noqa: BLE001, F821
"""The K3 MoE layer (896 experts, top-16, latent 3584, intermediate 3072, SiTU-GLU), every baseline in the same
process and run, on the same expert-sorted rows, ``--repeats`` interleaved medians (median, min-max); the copy
bandwidth and matmul rate measured first (the floors' ceilings). Rows:

- ``bf16``, 8192 and 256 tokens: our routed-expert block (``moe.moe_forward``: GLU GEMM with SiTU fused, down GEMM
  with the combine weight fused, per-token sum) against ``torch._grouped_mm`` GEMM only (gate, up, down on the same
  sorted rows; the down GEMM on a random intermediate of the same shape) and GEMM + eager SiTU + combine (the same
  function as ours, unfused): ratios baseline / ours for both.
- ``mxfp4``, 256 tokens: the expert block alone (``moe_forward`` on MXFP4 codes in the device layout) and the whole
  MoE layer as the frontend builds it (router, latent down projection, dispatch, experts, combine, norm, latent up
  projection, shared experts; ``k3ir.compile`` of that subgraph on the triton target, shipped defaults): ours only,
  against the weight-bytes floor at the measured copy bandwidth (there is no same-input baseline for MXFP4).

    python3 bench/bench_moe_layer.py          # JSON to bench/results/bench_moe_layer/<date>-<commit>.json
    TRITON_INTERPRET=1 python bench/bench_moe_layer.py --tiny --out /tmp/moe.json     # CPU check of the script

``--tiny``: 8 experts, D = I = 64 (k3-tiny's MoE layer for the whole-layer row), top-2, 64 and 16 tokens, float32.
``--warm``: each case once (compiles), nothing timed or written. Table last."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import rel, result_path, sort_by_expert


def moe_layer_module(name: str, tokens: int, quant: str = "mxfp4"):
    """The MoE layer of model ``name`` (first MoE layer index) as a one-function IR module ``forward(x [1, tokens,
    hidden]) -> [1, tokens, hidden]``, built by the frontend's own layer code (``_ModelBuilder.moe``), experts in
    ``quant``. Returns (module, model config)."""
    from k3ir.frontend.model import _ModelBuilder, module_attrs

    import k3ir
    from k3ir.ir import Function, Module
    from k3ir.types import TensorType
    from k3ir.verify import verify_module
    cfg = k3ir.load(name).config
    i = next(j for j in range(cfg.num_hidden_layers) if cfg.is_moe(j))
    m = Module(f"{name}_moe_layer", module_attrs(cfg))
    m.attrs["expert_quant"] = quant
    fn = Function("forward")
    from k3ir.builder import Builder
    b = Builder(m, fn)
    x = b.arg("x", TensorType(cfg.dtype, (1, tokens, cfg.hidden_size)))
    b.ret(_ModelBuilder(cfg, m).moe(b, x, i))
    m.add_function(fn)
    verify_module(m)
    return m, cfg


def compare(tiny: bool, out: str, repeats: int = 3, warm: bool = False, parts: str = "bf16,mxfp4") -> dict:
    """The same-run comparison of the module docstring. Returns the report's data (``benchlib.Report``)."""
    from benchlib import Report, fmt_ms, interleaved, print_table
    from k3ir.backends.triton.moe import grouped as moe
    gpu = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    E, D, I, k = (8, 64, 64, 2) if tiny else (896, 3584, 3072, 16)
    rep = Report("bench_moe_layer", out, sys.argv)
    if not warm:
        rep.ceilings()
    gen = torch.Generator(device=dev).manual_seed(0)
    esz = 2 if dt == torch.bfloat16 else 4
    if "bf16" in parts:
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
            gemm_only()
            r = {"case": "bf16 experts", "tokens": T, "experts": E, "top_k": k, "hidden": D, "intermediate": I,
                 "dtype": str(dt)[6:], "experts_used": int((cnt > 0).sum()), "err_ours_vs_grouped_mm": rel(a, b),
                 "err_grouped_mm_vs_ours": rel(b, a), "ours_finite": bool(torch.isfinite(a).all())}
            del a, b
            if warm:
                continue
            t0 = time.time()
            t = interleaved({"ours": ours, "gemm_only": gemm_only, "gemm_eager": gemm_eager}, repeats, rep_ms=300)
            wbytes = 3 * I * D * r["experts_used"] * esz
            flops = 2 * T * k * 3 * I * D
            med = t["ours"]["median"] * 1e-3
            r.update(ours_ms=t["ours"], grouped_mm_gemm_only_ms=t["gemm_only"], grouped_mm_eager_ms=t["gemm_eager"],
                     ratio_gemm_only_over_ours=t["gemm_only"]["median"] / t["ours"]["median"],
                     ratio_eager_over_ours=t["gemm_eager"]["median"] / t["ours"]["median"],
                     weight_bytes=wbytes, flops=flops,
                     floor_ms=max(wbytes / rep.copy_Bps, flops / rep.matmul_flops) * 1e3,
                     ours_weight_bw_frac=wbytes / rep.copy_Bps / med, ours_flop_frac=flops / rep.matmul_flops / med,
                     gemm_only_weight_bw_frac=wbytes / rep.copy_Bps / (t["gemm_only"]["median"] * 1e-3),
                     gemm_only_flop_frac=flops / rep.matmul_flops / (t["gemm_only"]["median"] * 1e-3),
                     timing_s=time.time() - t0)
            rep.add(r)
            del xs, h_in
        del w1, w3, w2, w1t, w3t, w2t
        if gpu:
            torch.cuda.empty_cache()
    if "mxfp4" in parts:
        _mxfp4_rows(rep, tiny, repeats, warm, dev, dt, E, D, I, k, gen)
    if warm:
        return rep.data
    m = rep.data["meta"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['commit']}, {m['date']}; K3IR_* "
          f"switches: {m['env_switches'] or 'none'}")
    rows = rep.data["rows"]
    print_table(["case", "tokens", "ours ms (min-max)", "_grouped_mm GEMM only", "GEMM+eager SiTU+combine",
                 "GEMM-only/ours", "eager/ours", "ours bytes %", "ours flop %", "err vs eager"],
                [[r["case"], r["tokens"], fmt_ms(r["ours_ms"]), fmt_ms(r.get("grouped_mm_gemm_only_ms")),
                  fmt_ms(r.get("grouped_mm_eager_ms")),
                  f"{r['ratio_gemm_only_over_ours']:.3f}" if "ratio_gemm_only_over_ours" in r else None,
                  f"{r['ratio_eager_over_ours']:.3f}" if "ratio_eager_over_ours" in r else None,
                  f"{r['ours_weight_bw_frac']:.1%}", f"{r['ours_flop_frac']:.1%}",
                  f"{r['err_ours_vs_grouped_mm']:.1e}" if "err_ours_vs_grouped_mm" in r else None] for r in rows])
    return rep.data


def _mxfp4_rows(rep, tiny, repeats, warm, dev, dt, E, D, I, k, gen):
    """MXFP4 at 256 tokens (16 with ``tiny``): the expert block alone, then the whole layer (module docstring)."""
    from benchlib import interleaved, random_params
    from k3ir.backends.triton.moe import grouped as moe
    from k3ir.backends.triton.moe import layout as moe_layout

    import k3ir
    T = 16 if tiny else 256
    p = [torch.randint(0, 256, s, device=dev, dtype=torch.uint8, generator=gen)
         for s in ((E, I, D // 2), (E, I, D // 2), (E, D, I // 2))]
    sc = [torch.randint(118, 123, s, device=dev, dtype=torch.uint8, generator=gen)
          for s in ((E, I, D // 32), (E, I, D // 32), (E, D, I // 32))]
    for j in range(3):          # the device layout the triton executable prepares
        p[j], sc[j] = moe_layout.prepare(p[j], sc[j])
    idx = torch.topk(torch.randn(T, E, device=dev, generator=gen), k, dim=-1).indices
    order, inv, cnt, off = sort_by_expert(idx, E)
    xs = torch.randn(T, D, device=dev, dtype=dt, generator=gen)[order // k].contiguous()
    cw = torch.rand(T * k, device=dev, generator=gen)
    inv3 = inv.reshape(1, T, k)

    def experts(xs=xs, off=off, cw=cw, inv3=inv3):
        return moe.moe_forward(xs, off, p[0], p[1], p[2], cw, inv3, "mxfp4", (sc[0], sc[1], sc[2]), act="situ")
    y = experts()
    used = int((cnt > 0).sum())
    r = {"case": "mxfp4 experts", "tokens": T, "experts": E, "top_k": k, "hidden": D, "intermediate": I,
         "experts_used": used, "ours_finite": bool(torch.isfinite(y).all()),
         "note": "the expert block alone (dispatched rows in, combined rows out); no same-input baseline"}
    if not warm:
        t = interleaved({"ours": experts}, repeats, rep_ms=200)
        wbytes = 3 * I * D * used * (0.5 + 1 / 32)
        flops = 2 * T * k * 3 * I * D
        med = t["ours"]["median"] * 1e-3
        r.update(ours_ms=t["ours"], weight_bytes=wbytes, flops=flops,
                 floor_ms=max(wbytes / rep.copy_Bps, flops / rep.matmul_flops) * 1e3,
                 ours_weight_bw_frac=wbytes / rep.copy_Bps / med, ours_flop_frac=flops / rep.matmul_flops / med)
        rep.add(r)
    del p, sc, xs, y
    if dev == "cuda":
        torch.cuda.empty_cache()
    name = "k3-tiny" if tiny else "kimi-k3"
    try:
        m, cfg = moe_layer_module(name, T)
        exe = k3ir.compile(m, target="triton", dtype="bfloat16" if dt == torch.bfloat16 else "float32", device=dev)
        params = exe.prepare_params(random_params(exe.module, dev))
        x = torch.randn(1, T, cfg.hidden_size, device=dev, generator=gen).to(dt)

        def layer(x=x):
            return exe.run("forward", [x], params)
        y = layer()[0]
        nbytes = sum(v.numel() * v.element_size() for n_, v in params.items() if ".experts." not in n_)
        ebytes = sum(v.numel() * v.element_size() for n_, v in params.items() if ".experts." in n_)
        d, Dl, Il = cfg.hidden_size, cfg.latent_size or cfg.hidden_size, cfg.moe_intermediate_size
        flops = 2 * T * (cfg.num_experts * d + (2 * Dl * d if cfg.latent_size else 0) + cfg.top_k * 3 * Il * Dl
                         + 3 * Il * cfg.num_shared_experts * d)
        r = {"case": "mxfp4 whole layer", "tokens": T, "model": name, "experts": cfg.num_experts,
             "top_k": cfg.top_k, "hidden": cfg.hidden_size, "latent": cfg.latent_size,
             "intermediate": cfg.moe_intermediate_size, "shared_experts": cfg.num_shared_experts,
             "ours_finite": bool(torch.isfinite(y).all()),
             "note": "router + latent down + dispatch + experts + combine + norm + latent up + shared experts, "
                     "k3ir.compile of the frontend's MoE layer (triton target, shipped defaults); no same-input "
                     "baseline"}
        if not warm:
            t = interleaved({"ours": layer}, repeats, rep_ms=200)
            used = min(cfg.num_experts, T * cfg.top_k)     # upper bound of the experts a batch can touch
            wbytes = nbytes + ebytes * used / cfg.num_experts
            med = t["ours"]["median"] * 1e-3
            r.update(ours_ms=t["ours"], weight_bytes_upper=wbytes, flops=flops,
                     floor_ms=max(wbytes / rep.copy_Bps, flops / rep.matmul_flops) * 1e3,
                     ours_weight_bw_frac=wbytes / rep.copy_Bps / med, ours_flop_frac=flops / rep.matmul_flops / med)
            rep.add(r)
        del exe, params
    except Exception as e:
        rep.add({"case": "mxfp4 whole layer", "tokens": T, "error": repr(e)[:400], "ours_ms": None,
                 "ours_weight_bw_frac": 0.0, "ours_flop_frac": 0.0})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/bench_moe_layer/<date>-<commit>.json)")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="bf16,mxfp4", help="bf16 and/or mxfp4 rows")
    ap.add_argument("--warm", action="store_true", help="each case once (compiles); nothing timed or written")
    a = ap.parse_args()
    compare(a.tiny, a.out or result_path("bench_moe_layer"), a.repeats, a.warm, a.parts)


if __name__ == "__main__":
    main()
