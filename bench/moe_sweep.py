# ruff: noqa: BLE001
"""MoE grouped-GEMM variants on the GPU, one call under ~2 minutes: one K3 MoE layer (E=896, top-16, D=3584,
I=3072), MXFP4 at 256 and 8192 tokens, bf16 at 8192 and 256, Kimi Linear decode sizes (``VARIANTS``). Per case,
``torch._grouped_mm`` (GEMM + eager SiTU + combine; on dequantised bf16 weights for MXFP4) and every variant's whole
layer are timed in the same process on the same sorted rows, ``--repeats`` interleaved medians (median, min-max),
then each variant's launches (GLU, down) the same way; the variant's error against that baseline; the copy bandwidth
and matmul rate measured first (floors). Then every compiled MoE kernel with its registers/spills. Table last; JSON
(``--out``, default ``bench/results/moe_sweep/<date>-<commit>.json``) after every row. Errors keep their last 1500
characters. The first variant of each case is the shipped default; the others are tuning candidates.

    python3 bench/moe_sweep.py [--only SUBSTR,...] [--budget 80]
    TRITON_INTERPRET=1 python bench/moe_sweep.py --tiny --out /tmp/moe_sweep.json     # CPU check of the script
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import current_report, interleaved, rel, row, sort_by_expert

DEV, DT = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
REPEATS = 3


def _route(T, E, k):
    """Uniform random top-k routing, sorted like k3.moe_dispatch: (order, inv [1,T,k], offsets, int32 ends)."""
    order, inv, cnt, off = sort_by_expert(torch.topk(torch.randn(T, E, device=DEV), k, dim=-1).indices, E)
    return order, inv.reshape(1, T, k), off, cnt.cumsum(0).to(torch.int32)


def _deq_bf16(quant, p, s):
    import k3ir.backends.torch.ops  # noqa: F401  (import order: ops before fused)
    from k3ir.backends.torch.fused import dequantize
    out = torch.empty(*p.shape[:2], s.shape[-1] * 32, device=DEV, dtype=DT)
    for i in range(0, p.shape[0], 16):
        out[i:i + 16] = dequantize(quant, p[i:i + 16], s[i:i + 16], torch.float32).to(DT)
    return out


# (label, quant, tokens, [(name, (glu config, down config), mxfp4 decode)]); configs: ("t", BW, BT, TAIL, BK,
# warps, stages) = swapped kernel, 6-tuple = row-major (BM, BN, BK, MS, warps, stages), None = moe._config.
# bench/probes/moe_offline.py compiles every one of these for sm_90 (Triton 3.6) before a GPU run.
T128 = ("t", 128, 128, 64, 64, 8, 3)
T128S4 = ("t", 128, 128, 64, 64, 8, 4)
VARIANTS = [
    ("MXFP4 T=256", "mxfp4", 256, [
        ("default (t, auto = asm1 here)", (None, None), None),
        ("t asm (two fma)", (None, None), "asm"),
        ("t word1 (int32 words, one fma) 64/16+16 BK128 s4 both", (("t", 64, 16, 16, 128, 4, 4),) * 2, "word1"),
    ]),
    ("MXFP4 T=8192", "mxfp4", 8192, [("default (t, auto)", (None, None), None)]),
    ("bf16 T=8192", "none", 8192, [
        ("default (t 128/128+64|+32 s4 both)", (None, None), None),
        ("t 128/128+64 s4 both (no TAIL2; 23.64 ms at 01:53)", (T128S4, T128S4), None),
        ("t 128/128+64 s3 both (24.17 ms at 01:53)", (T128, T128), None),
    ]),
    ("bf16 T=256", "none", 256, [("default", (None, None), None)]),
    # Kimi Linear decode (E 64, top-8, D 2048, I 1024): per-launch times from CUDA-graph replays
    ("KL bf16 B=1", "none", 1, [
        ("default (t 32/16 BK128 s4, row grid)", (None, None), None),
        ("old t 64/16+16 BK128 s4, expert grid", (("t", 64, 16, 16, 128, 4, 4),) * 2, None, {"rowgrid": False}),
        ("t 64/16+16 BK128 s4, row grid", (("t", 64, 16, 16, 128, 4, 4),) * 2, None),
    ]),
    ("KL bf16 B=4", "none", 4, [("default (t 32/16 BK128 s4, row grid)", (None, None), None)]),
]
SHAPES = {"KL": (64, 2048, 1024, 8)}     # label prefix -> (experts, hidden, expert intermediate, top-k)


def shape_of(label, smoke=False):
    """(E, D, I, k) of a VARIANTS label: K3 (896, 3584, 3072, 16) unless a SHAPES prefix matches."""
    if smoke:
        return (8, 64, 64, 2)
    return SHAPES.get(label.split()[0], (896, 3584, 3072, 16))


def sweep(smoke, only=(), budget=80.0):
    """The VARIANTS (K3 MoE layer E=896, top-16, D=3584, I=3072; "KL" rows: Kimi Linear E=64, top-8, D=2048,
    I=1024), per case: the torch._grouped_mm path (GEMM + eager SiTU + combine; on dequantised bf16 weights for
    MXFP4) and every variant's whole layer timed interleaved, ``REPEATS`` medians each, on the same sorted rows (CUDA
    graph replays at decode sizes); then the variants' GLU and down launches the same way; each variant's error
    against the baseline; registers/spills of every compiled kernel. ``only``: substrings of "label name" to run.
    Stops starting cases after ``budget`` seconds."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes"))
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton.moe import grouped as moe
    t_start = time.perf_counter()
    rep = current_report()

    def theirs(xs, offs32, w1, w3, w2, cw, inv3):
        g = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs32)
        u = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs32)
        h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs32) * cw[:, None].to(DT)
        return y[inv3].float().sum(-2).to(DT)

    def with_rowgrid(fn, rowgrid):
        def f():
            moe.ROWGRID = rowgrid
            try:
                return fn()
            finally:
                moe.ROWGRID = True
        return f

    def case(label, T, quant, ws, ss, deq, variants):
        E, D, I, k = shape_of(label, smoke)
        small = T <= 4 and DEV == "cuda"          # decode sizes: time CUDA-graph replays
        order, inv3, off, offs32 = _route(T, E, k)
        x = torch.randn(T, D, device=DEV, dtype=DT)
        xs = x[order // k].contiguous()
        cw = torch.rand(T * k, device=DEV)
        used = int((off[1:] > off[:-1]).sum())
        flops = 2 * T * k * 3 * I * D
        bytes_el = (2 if DT == torch.bfloat16 else 4) if quant == "none" else (0.5 + 1 / 32)
        wel = 3 * E * I * D
        floor = max(wel * bytes_el * used / E / rep.copy_Bps, flops / rep.matmul_flops) * 1e3
        b_glu, b_down = 2 * used * I * D * bytes_el, used * I * D * bytes_el      # active weight bytes per launch
        base = "torch._grouped_mm" + ("" if quant == "none" else " (dequantised bf16)")

        def ref_fn():
            return theirs(xs, offs32, *deq, cw, inv3)
        ref = ref_fn()
        layer, launches, info = {base: ref_fn}, {}, {}
        for v in variants:
            name, cfgs, dec = v[:3]
            opts = v[3] if len(v) > 3 else {}
            if only and not any(o in f"{label} {name}" for o in only):
                continue
            rg = opts.get("rowgrid", True)
            try:
                def glu(cfgs=cfgs, dec=dec):
                    return moe.grouped_matmul(xs, off, ws[0], ss[0], quant, w3=ws[1], scales3=ss[1], act="situ",
                                              config=cfgs[0], mxfp4_decode=dec)

                def fn(cfgs=cfgs, dec=dec):
                    return moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv3, quant, ss, act="situ",
                                           configs=cfgs, mxfp4_decode=dec)
                out = with_rowgrid(fn, rg)()
                h = with_rowgrid(glu, rg)()

                def down(cfgs=cfgs, dec=dec, h=h):
                    return moe.grouped_matmul(h, off, ws[2], ss[2], quant, row_scale=cw, config=cfgs[1],
                                              mxfp4_decode=dec)
                with_rowgrid(down, rg)()
                R = xs.shape[0]
                planned = [moe.plan(R, E, n_, k_, quant, g_, xs.element_size(), c_)
                           for (n_, k_, g_), c_ in zip(((I, D, True), (D, I, False)), cfgs)]
                layer[name] = with_rowgrid(fn, rg)
                launches[name + " glu"], launches[name + " down"] = with_rowgrid(glu, rg), with_rowgrid(down, rg)
                info[name] = {"rel_err_vs_grouped_mm": rel(out, ref), "configs": str(planned), "decode": dec,
                              "rowgrid": rg and R < E, "shipped_default": v is variants[0]}
            except Exception as e:
                row("moe", f"{label} {name}", error=repr(e)[-1500:])
        t_layer = interleaved(layer, REPEATS, rep_ms=100, graph=small)
        t_launch = interleaved(launches, REPEATS, rep_ms=50, graph=small) if launches else {}
        row("moe", f"{label} {base}", ms=t_layer[base], floor_ms=floor, rows_per_expert=T * k / E,
            active_experts=used)
        for name, inf in info.items():
            ms, g_, d_ = t_layer[name], t_launch[name + " glu"], t_launch[name + " down"]
            row("moe", f"{label} {name}", ms=ms, ms_glu=g_, ms_down=d_,
                ratio_grouped_mm_over_ours=t_layer[base]["median"] / ms["median"], floor_ms=floor,
                frac_of_floor=floor / ms["median"],
                hbm_frac_glu=b_glu / rep.copy_Bps / (g_["median"] * 1e-3),
                hbm_frac_down=b_down / rep.copy_Bps / (d_["median"] * 1e-3), **inf)
        if time.perf_counter() - t_start > budget:
            raise TimeoutError(f"budget of {budget} s used after {label}")

    def wanted(lab):
        return not only or any(o in f"{lab} {v[0]}" for v in todo[lab][1] for o in only)

    todo = {lab: (T, vs) for lab, _, T, vs in VARIANTS}
    T_of = (lambda T: {8192: 64, 256: 16}.get(T, T)) if smoke else (lambda T: T)

    def weights(lab, quant):
        E, D, I, _ = shape_of(lab, smoke)
        shapes = ((E, I, D), (E, I, D), (E, D, I))
        if quant == "none":
            w = [torch.randn(*sh, device=DEV, dtype=DT) * 0.02 for sh in shapes]
            return w, (None,) * 3, w
        p = [torch.randint(0, 256, (a, b, c // 2), device=DEV, dtype=torch.uint8) for a, b, c in shapes]
        sc = [torch.randint(118, 123, (a, b, c // 32), device=DEV, dtype=torch.uint8) for a, b, c in shapes]
        return p, sc, [_deq_bf16("mxfp4", pp, ss) for pp, ss in zip(p, sc)]

    groups = [("none", ("KL bf16 B=1", "KL bf16 B=4")), ("mxfp4", ("MXFP4 T=256", "MXFP4 T=8192")),
              ("none", ("bf16 T=8192", "bf16 T=256"))]
    for quant, labs in groups:
        labs = [lab for lab in labs if wanted(lab)]
        if not labs:
            continue
        ws, ss, deq = weights(labs[0], quant)
        for lab in labs:
            T, vs = todo[lab]
            case(lab, T_of(T), quant, ws, ss, deq, vs)
        del ws, ss, deq
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    row("moe", "mxfp4 asm self-check (decode, device) -> matches reference",
        asm_ok={str(kk): v for kk, v in moe._ASM_OK.items()})
    for name, ck in compiled_kernels(moe):
        src = getattr(ck, "src", None)
        consts = {str(kk): v for kk, v in (getattr(src, "constants", None) or {}).items()
                  if isinstance(v, (int, float, str, bool))}
        row("moe", f"kernel {name}", regs=getattr(ck, "n_regs", -1), spills=getattr(ck, "n_spills", -1),
            smem=getattr(ck.metadata, "shared", -1), warps=getattr(ck.metadata, "num_warps", -1),
            stages=getattr(ck.metadata, "num_stages", -1), constexprs=str(consts)[:300])


def main():
    global REPEATS
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", "--smoke", action="store_true", help="toy sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--only", default="", help="comma-separated substrings of 'label name' to run (default: all)")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds after which no new case starts")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per candidate")
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/moe_sweep/<date>-<commit>.json)")
    a = ap.parse_args()
    from benchlib import Report, result_path
    REPEATS = a.repeats
    rep = Report("moe_sweep", a.out or result_path("moe_sweep"), sys.argv)
    rep.ceilings()
    t0 = time.perf_counter()
    try:
        sweep(a.tiny, tuple(o for o in a.only.split(",") if o), a.budget)
    except TimeoutError as e:
        row("moe", "stopped", note=str(e))
    except Exception as e:
        import traceback
        traceback.print_exc()
        row("moe", "FAILED", error=repr(e)[-1500:])
    row("moe", "total time", s=time.perf_counter() - t0)
    print("\n| name | median ms (min-max) | ratio _grouped_mm / ours | error | other |\n|---|---|---|---|---|")
    from benchlib import fmt_ms
    for r in rep.data["rows"]:
        other = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                          if k not in ("section", "name", "ms", "ms_glu", "ms_down", "ratio_grouped_mm_over_ours",
                                       "rel_err_vs_grouped_mm", "configs", "constexprs"))
        ratio = r.get("ratio_grouped_mm_over_ours")
        err = r.get("rel_err_vs_grouped_mm")
        print(f"| {r['name']} | {fmt_ms(r.get('ms'))} | {'-' if ratio is None else f'{ratio:.3f}'} | "
              f"{'-' if err is None else f'{err:.1e}'} | {other[:200]} |")


if __name__ == "__main__":
    main()
