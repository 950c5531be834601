# ruff: noqa: BLE001
"""MoE grouped-GEMM variants on the GPU (issue 6), one call under 3 minutes: one K3 MoE layer
(E=896, top-16, D=3584, I=3072) in bf16 at 8192 and 256 tokens, MXFP4 at 256 and 8192, INT4 at 256;
each variant timed (median, triton.testing.do_bench), compared with torch._grouped_mm (bf16; on
dequantised bf16 weights for the packed formats: also the rel err reference), then every compiled
MoE kernel with its registers/spills. Table last; JSON to $OUT/moe_sweep.json after every row.

    python3 bench/moe_sweep.py [--smoke]      (--smoke: tiny sizes, CPU interpreter too)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _route(T, E, k):
    """Uniform random top-k routing, sorted like k3.moe_dispatch: (order, inv [1,T,k], offsets, int32 ends)."""
    idx = torch.topk(torch.randn(T, E, device=DEV), k, dim=-1).indices
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=DEV)
    cnt = torch.bincount(flat, minlength=E)
    return order, inv.reshape(1, T, k), torch.cat([cnt.new_zeros(1), cnt.cumsum(0)]), cnt.cumsum(0).to(torch.int32)


def _deq_bf16(quant, p, s):
    import k3ir.backends.torch.ops  # noqa: F401  (import order: ops before fused)
    from k3ir.backends.torch.fused import dequantize
    out = torch.empty(*p.shape[:2], s.shape[-1] * 32, device=DEV, dtype=DT)
    for i in range(0, p.shape[0], 16):
        out[i:i + 16] = dequantize(quant, p[i:i + 16], s[i:i + 16], torch.float32).to(DT)
    return out


def sweep(smoke):
    """Variants of the MoE layer kernels (K3: E=896, top-16, D=3584, I=3072), each timed, checked
    against the torch._grouped_mm path (on dequantised bf16 weights for MXFP4/INT4) and listed with
    registers/spills. Configs: ("t", BW, BT, TAIL, BK, warps, stages) = swapped kernel; 6-tuple =
    row-major kernel (BM, BN, BK, MS, warps, stages). Stops starting variants after ~170 s."""
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton import moe
    E, D, I, k = (8, 64, 64, 2) if smoke else (896, 3584, 3072, 16)
    T_big, T_small = (64, 16) if smoke else (8192, 256)
    t_start = time.perf_counter()
    wel = 3 * E * I * D

    def theirs(xs, offs32, w1, w3, w2, cw, inv3):
        g = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs32)
        u = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs32)
        h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs32) * cw[:, None].to(DT)
        return y[inv3].float().sum(-2).to(DT)

    def case(label, T, quant, ws, ss, deq, variants):
        order, inv3, off, offs32 = _route(T, E, k)
        x = torch.randn(T, D, device=DEV, dtype=DT)
        xs = x[order // k].contiguous()
        cw = torch.rand(T * k, device=DEV)
        used = int((off[1:] > off[:-1]).sum())
        flops = 2 * T * k * 3 * I * D
        bytes_el = 2 if quant == "none" else (0.5 + 1 / 32)
        floor = max(wel * bytes_el * used / E / HBM, flops / MM) * 1e3
        ref = theirs(xs, offs32, *deq, cw, inv3) if torch.cuda.is_available() else None
        t_ref = bench(lambda: theirs(xs, offs32, *deq, cw, inv3), 100) if ref is not None else float("nan")
        row("moe", f"{label} torch._grouped_mm" + ("" if quant == "none" else " (dequantised bf16)"),
            ms=t_ref, floor_ms=floor, rows_per_expert=T * k / E)
        for name, cfgs, dec in variants:
            if time.perf_counter() - t_start > 170:
                row("moe", f"{label} {name}", skipped="time budget")
                continue
            try:
                def fn(cfgs=cfgs, dec=dec):
                    return moe.moe_forward(xs, off, ws[0], ws[1], ws[2], cw, inv3, quant, ss, act="situ",
                                           configs=cfgs, mxfp4_decode=dec)
                out = fn()
                err = rel(out, ref) if ref is not None else None
                ms = bench(fn, 100)
                row("moe", f"{label} {name}", ms=ms, speedup_vs_grouped_mm=t_ref / ms, floor_ms=floor,
                    frac_of_floor=floor / ms, rel_err=err, configs=str(cfgs), decode=dec)
            except Exception as e:
                row("moe", f"{label} {name}", error=repr(e)[:300])

    # MXFP4 ------------------------------------------------------------------------------------
    shapes = ((E, I, D), (E, I, D), (E, D, I))
    p = [torch.randint(0, 256, (a, b, c // 2), device=DEV, dtype=torch.uint8) for a, b, c in shapes]
    sc = [torch.randint(118, 123, (a, b, c // 32), device=DEV, dtype=torch.uint8) for a, b, c in shapes]
    deq = [_deq_bf16("mxfp4", pp, ss) for pp, ss in zip(p, sc)]
    case(f"MXFP4 T={T_small}", T_small, "mxfp4", p, sc, deq, [
        ("default (t, asm)", (None, None), None),
        ("t exact decode", (None, None), "exact"),
        ("t asm1 (one fma)", (None, None), "asm1"),
        ("rowmajor BM16 asm", ((16, 64, 256, 1, 4, 3), (16, 128, 256, 1, 4, 3)), "asm"),
        ("rowmajor BM16 exact (old)", ((16, 64, 256, 1, 4, 3), (16, 128, 256, 1, 4, 3)), "exact"),
        ("t 128/16+16 BK256 asm", (("t", 128, 16, 16, 256, 4, 3),) * 2, "asm"),
        ("t 64/16+16 BK128 s4 asm", (("t", 64, 16, 16, 128, 4, 4),) * 2, "asm"),
    ])
    case(f"MXFP4 T={T_big}", T_big, "mxfp4", p, sc, deq, [
        ("default (t, asm)", (None, None), None),
        ("t exact decode", (None, None), "exact"),
    ])
    del p, sc, deq
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    # INT4 -------------------------------------------------------------------------------------
    p = [torch.randint(-2**31, 2**31 - 1, (a, b, c // 8), device=DEV, dtype=torch.int32) for a, b, c in shapes]
    sc = [torch.rand(a, b, c // 32, device=DEV) * 0.01 for a, b, c in shapes]
    deq = [_deq_bf16("int4", pp, ss) for pp, ss in zip(p, sc)]
    case(f"INT4 T={T_small}", T_small, "int4", p, sc, deq, [
        ("default (t)", (None, None), None),
        ("rowmajor BM16 (old)", ((16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 4)), None),
    ])
    del p, sc, deq
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    # bf16 -------------------------------------------------------------------------------------
    w = [torch.randn(E, I, D, device=DEV, dtype=DT) * 0.02, torch.randn(E, I, D, device=DEV, dtype=DT) * 0.02,
         torch.randn(E, D, I, device=DEV, dtype=DT) * 0.02]
    case(f"bf16 T={T_big}", T_big, "none", w, (None,) * 3, w, [
        ("default", (None, None), None),
        ("rowmajor glu256x64 down128x256 (old best)", ((256, 64, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3)), None),
        ("t 64/128+32 | 128/128+32", (("t", 64, 128, 32, 64, 8, 3), ("t", 128, 128, 32, 64, 8, 3)), None),
        ("t 64/128+64 s4 | 128/128+64 s4", (("t", 64, 128, 64, 64, 8, 4), ("t", 128, 128, 64, 64, 8, 4)), None),
        ("t 128/128+64 | 128/128+64", (("t", 128, 128, 64, 64, 8, 3), ("t", 128, 128, 64, 64, 8, 3)), None),
        ("t 64/256 | 128/256", (("t", 64, 256, 0, 64, 8, 3), ("t", 128, 256, 0, 64, 8, 3)), None),
        ("t 64/128+64 BK128 s2 | 128/128+64 BK128 s2",
         (("t", 64, 128, 64, 128, 8, 2), ("t", 128, 128, 64, 128, 8, 2)), None),
    ])
    case(f"bf16 T={T_small}", T_small, "none", w, (None,) * 3, w, [
        ("default", (None, None), None),
        ("rowmajor BM16 (old default)", ((16, 64, 64, 1, 4, 4), (16, 128, 64, 1, 4, 4)), None),
        ("t 128/16+16 BK128", (("t", 128, 16, 16, 128, 4, 4),) * 2, None),
        ("t 64/16+16 BK256 s3", (("t", 64, 16, 16, 256, 4, 3),) * 2, None),
    ])
    del w
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
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
    a = ap.parse_args()
    if torch.cuda.is_available():
        import triton
        row("env", "device", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    t0 = time.perf_counter()
    try:
        sweep(a.smoke)
    except Exception as e:
        import traceback
        traceback.print_exc()
        row("moe", "FAILED", error=repr(e)[:400])
    row("moe", "total time", s=time.perf_counter() - t0)
    print("\n| name | numbers |\n|---|---|")
    for r in ROWS:
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("section", "name"))
        print(f"| {r['name']} | {nums} |")


if __name__ == "__main__":
    main()
