# ruff: noqa: BLE001
"""MoE grouped-GEMM variants on the GPU (issue 6), one call under ~2 minutes: one K3 MoE layer
(E=896, top-16, D=3584, I=3072), MXFP4 at 256 and 8192 tokens, bf16 at 8192 and 256 (``VARIANTS``);
each variant timed as a layer and per launch (GLU, down; median, triton.testing.do_bench), checked
against torch._grouped_mm (on dequantised bf16 weights for MXFP4; timed again only with --baselines),
then every compiled MoE kernel with its registers/spills. Table last; JSON to $OUT/moe_sweep.json
after every row. Errors keep their last 1500 characters.

    python3 bench/moe_sweep.py [--smoke] [--baselines]   (--smoke: tiny sizes, CPU interpreter too)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models
from bench_models import rel
from benchlib import sort_by_expert

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HBM = 4.25e12          # copy bandwidth measured on the H200 (bytes/s)
MM = 679e12            # bf16 matmul rate measured by the issue author
ROWS: list[dict] = []
OUT = os.environ.get("OUT", ".")
DEV, DT = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def row(section, name, **kv):
    r = {"section": section, "name": name, **kv}
    ROWS.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "moe_sweep.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


def bench(fn, rep_ms=100):
    return bench_models.bench(fn, rep_ms, warmup_ms=10)


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


def _bench_graph(fn, rep_ms=50):
    """Median ms of ``fn`` replayed from a CUDA graph (decode-size launches: no Python launch overhead);
    do_bench when capture fails or without a GPU."""
    if not torch.cuda.is_available():
        return bench(fn)
    try:
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    except Exception:
        return bench(fn, rep_ms)


def sweep(smoke, baselines, only=(), budget=80.0):
    """The VARIANTS (K3 MoE layer E=896, top-16, D=3584, I=3072; "KL" rows: Kimi Linear E=64, top-8, D=2048,
    I=1024): each timed as a whole layer and per launch (GLU, down), checked against the torch._grouped_mm
    path (on dequantised bf16 weights for MXFP4/INT4; its time only with ``baselines``: measured 2026-11-30
    bf16 T=256 17.7 ms, T=8192 30.66 ms) and listed with registers/spills. ``only``: substrings of
    "label name" to run. Stops starting variants after ``budget`` seconds."""
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton import moe
    t_start = time.perf_counter()
    known = {("none", 256): 17.7, ("none", 8192): 30.66, ("mxfp4", 256): 17.62, ("mxfp4", 8192): 28.69}

    def theirs(xs, offs32, w1, w3, w2, cw, inv3):
        g = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs32)
        u = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs32)
        h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs32) * cw[:, None].to(DT)
        return y[inv3].float().sum(-2).to(DT)

    def case(label, T, quant, ws, ss, deq, variants):
        E, D, I, k = shape_of(label, smoke)
        small = T <= 4          # decode sizes: time CUDA-graph replays
        order, inv3, off, offs32 = _route(T, E, k)
        x = torch.randn(T, D, device=DEV, dtype=DT)
        xs = x[order // k].contiguous()
        cw = torch.rand(T * k, device=DEV)
        used = int((off[1:] > off[:-1]).sum())
        flops = 2 * T * k * 3 * I * D
        bytes_el = 2 if quant == "none" else (0.5 + 1 / 32)
        wel = 3 * E * I * D
        floor = max(wel * bytes_el * used / E / HBM, flops / MM) * 1e3
        b_glu, b_down = 2 * used * I * D * bytes_el, used * I * D * bytes_el      # active weight bytes per launch
        ref = theirs(xs, offs32, *deq, cw, inv3) if torch.cuda.is_available() else None
        t_ref = known.get((quant, T), float("nan")) if not smoke and not label.startswith("KL") else float("nan")
        if baselines and ref is not None:
            t_ref = (_bench_graph if small else bench)(lambda: theirs(xs, offs32, *deq, cw, inv3), 100)
        row("moe", f"{label} torch._grouped_mm" + ("" if quant == "none" else " (dequantised bf16)"),
            ms=t_ref, measured_now=bool(baselines), floor_ms=floor, rows_per_expert=T * k / E, active_experts=used)
        for v in variants:
            name, cfgs, dec = v[:3]
            opts = v[3] if len(v) > 3 else {}
            if only and not any(o in f"{label} {name}" for o in only):
                continue
            if time.perf_counter() - t_start > budget:
                row("moe", f"{label} {name}", skipped="time budget")
                continue
            moe.ROWGRID = opts.get("rowgrid", True)
            try:
                def glu(cfgs=cfgs, dec=dec):
                    return moe.grouped_matmul(xs, off, ws[0], ss[0], quant, w3=ws[1], scales3=ss[1], act="situ",
                                              config=cfgs[0], mxfp4_decode=dec)

                def fn(cfgs=cfgs, dec=dec):
                    return moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv3, quant, ss, act="situ",
                                           configs=cfgs, mxfp4_decode=dec)
                out = fn()
                err = rel(out, ref) if ref is not None else None
                h = glu()

                def down(cfgs=cfgs, dec=dec, h=h):
                    return moe.grouped_matmul(h, off, ws[2], ss[2], quant, row_scale=cw, config=cfgs[1],
                                              mxfp4_decode=dec)
                tb = _bench_graph if small else bench
                ms = tb(fn, 100)
                ms_glu = tb(glu, 50)
                ms_down = tb(down, 50)
                R = xs.shape[0]
                planned = [moe.plan(R, E, n_, k_, quant, g_, xs.element_size(), c_)
                           for (n_, k_, g_), c_ in zip(((I, D, True), (D, I, False)), cfgs)]
                row("moe", f"{label} {name}", ms=ms, ms_glu=ms_glu, ms_down=ms_down,
                    speedup_vs_grouped_mm=t_ref / ms, floor_ms=floor, frac_of_floor=floor / ms, rel_err=err,
                    hbm_frac_glu=b_glu / HBM / (ms_glu * 1e-3), hbm_frac_down=b_down / HBM / (ms_down * 1e-3),
                    configs=str(planned), decode=dec, rowgrid=moe.ROWGRID and R < E)
            except Exception as e:
                row("moe", f"{label} {name}", error=repr(e)[-1500:])
            finally:
                moe.ROWGRID = True

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
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--baselines", action="store_true", help="time torch._grouped_mm again (else known numbers)")
    ap.add_argument("--only", default="", help="comma-separated substrings of 'label name' to run (default: all)")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds after which no new variant starts")
    a = ap.parse_args()
    if torch.cuda.is_available():
        import triton
        row("env", "device", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    t0 = time.perf_counter()
    try:
        sweep(a.smoke, a.baselines, tuple(o for o in a.only.split(",") if o), a.budget)
    except Exception as e:
        import traceback
        traceback.print_exc()
        row("moe", "FAILED", error=repr(e)[-1500:])
    row("moe", "total time", s=time.perf_counter() - t0)
    print("\n| name | numbers |\n|---|---|")
    for r in ROWS:
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        print(f"| {r['name']} | {nums} |")


if __name__ == "__main__":
    main()
