"""Forward+backward of the triton target's KDA (``kda_forward`` with the chunked Triton backward,
backends/triton/kda_bwd*.py) against fla ``chunk_kda`` on one GPU (issue 5).

Sections (each guarded: one failure never stops the rest; a global deadline skips what is left):
1. ``accuracy``: B1 T2048 H4 D128 bf16, gradients of ours and of fla against an fp32 reference
   (our torch recompute on fp32 inputs), rel err per input (fla's tolerance: 8e-3).
2. ``time``: fwd+bwd of ours and fla (median ms), our forward alone, our backward per launch
   (each launch timed alone), gradients rel err ours vs fla, at B1 T32768 H32 D128 (K3 gate and
   softplus) and B8 T4096 H32 D128 (K3 gate).
3. ``regs``: registers / spills / shared memory of every backward kernel compiled so far.
4. ``sweep``: launch variants of the backward (``kda_bwd.TUNING``) at B1 T32768 H32 K3: per-launch ms.
Prints the tables last and writes JSON (``--out``, default ``$OUT/bench_kda_bwd.json``).

    PYTHONPATH=<fla wheel dir> python bench/bench_kda_bwd.py [--quick] [--budget 170]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
T0 = time.time()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def bench(fn, rep=200):
    import triton.testing as tt
    return float(tt.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def inputs(B, T, H, D, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, device="cuda", generator=g).to(dt)
    return {"q": r(B, T, H, D), "k": r(B, T, H, D), "v": r(B, T, H, D), "g": r(B, T, H, D), "beta": r(B, T, H),
            "A_log": (torch.rand(H, device="cuda", generator=g) * 2 - 1).float(),
            "dt_bias": r(H * D, dt=torch.float32)}


def ours_fb(x, lb, do):
    from k3ir.backends.triton import kda_forward
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}

    def run():
        for t in leaves.values():
            t.grad = None
        o, _ = kda_forward(*(leaves[n] for n in NAMES), lower_bound=lb)
        o.backward(do)
    return run, leaves


def fla_fb(chunk_kda, x, lb, do):
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
    kw = {"safe_gate": True, "lower_bound": lb} if lb is not None else {}

    def run():
        for t in leaves.values():
            t.grad = None
        o, _ = chunk_kda(*(leaves[n] for n in NAMES[:5]), A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                         use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **kw)
        o.backward(do)
    return run, leaves


def grads(leaves):
    return {n: leaves[n].grad.detach().clone() for n in NAMES}


def per_kernel(x, lb, do, n=3):
    from k3ir.backends.triton.kda_bwd import kda_backward
    t: dict = {}
    for _ in range(n):
        kda_backward(*(x[k] for k in NAMES), None, do, None, lb, timings=t)
    return {k: v / n for k, v in t.items()}


def section_accuracy(rows, chunk_kda):
    from k3ir.backends.triton.kda_torch import kda_chunk_torch
    for gate, lb in (("k3", -5.0), ("softplus", None)):
        x = inputs(1, 2048, 4, 128, seed=1)
        do = torch.randn_like(x["v"])
        ref_leaves = {n: x[n].float().clone().requires_grad_() for n in NAMES}
        o, _ = kda_chunk_torch(*(ref_leaves[n] for n in NAMES), lower_bound=lb)
        o.backward(do.float())
        ref = grads(ref_leaves)
        row = {"section": "accuracy", "gate": gate, "shape": [1, 2048, 4, 128]}
        run, lv = ours_fb(x, lb, do)
        run()
        g = grads(lv)
        row["ours"] = {n: rel(g[n], ref[n]) for n in NAMES}
        if chunk_kda is not None:
            run, lv = fla_fb(chunk_kda, x, lb, do)
            run()
            g = grads(lv)
            row["fla"] = {n: rel(g[n], ref[n]) for n in NAMES}
        rows.append(row)
        print(json.dumps(row), flush=True)


def section_time(rows, chunk_kda, shapes):
    from k3ir.backends.triton import kda_forward
    for shape, gate, lb in shapes:
        if time.time() - T0 > ARGS.budget * 0.6:
            print("time budget: skipping", shape, gate)
            continue
        x = inputs(*shape, seed=0)
        do = torch.randn_like(x["v"])
        row = {"section": "time", "shape": list(shape), "gate": gate}
        try:
            run, lv = ours_fb(x, lb, do)
            row["ours_fb_ms"] = bench(run)
            g_ours = grads(lv)
            with torch.no_grad():
                row["ours_fwd_ms"] = bench(lambda x=x, lb=lb: kda_forward(*(x[n] for n in NAMES), lower_bound=lb))
            row["ours_bwd_ms"] = row["ours_fb_ms"] - row["ours_fwd_ms"]
            row["kernels_ms"] = per_kernel(x, lb, do)
        except Exception as e:  # noqa: BLE001 - record and go on
            row["ours_error"] = repr(e)[:300]
            traceback.print_exc()
            g_ours = None
        torch.cuda.empty_cache()
        if chunk_kda is not None:
            try:
                run, lv = fla_fb(chunk_kda, x, lb, do)
                row["fla_fb_ms"] = bench(run)
                if g_ours is not None:
                    g_fla = grads(lv)
                    row["rel_vs_fla"] = {n: rel(g_ours[n], g_fla[n]) for n in NAMES}
                    row["fla_over_ours"] = row["fla_fb_ms"] / row["ours_fb_ms"]
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()


def section_regs(rows):
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton import kda_bwd_kernels
    for name, ck in compiled_kernels(kda_bwd_kernels):
        md = ck.metadata
        row = {"section": "regs", "kernel": name, "regs": getattr(ck, "n_regs", -1),
               "spills": getattr(ck, "n_spills", -1), "smem": getattr(md, "shared", -1),
               "warps": getattr(md, "num_warps", -1), "stages": getattr(md, "num_stages", -1)}
        rows.append(row)


def section_sweep(rows, quick):
    from k3ir.backends.triton import kda_bwd as KB
    base = dict(KB.TUNING)
    variants = [("default", {}), ("wy w8", {"w_wy": 8}), ("wy bk64", {"bk_wy": 64}), ("wy bv32", {"bv_wy": 32}),
                ("intra w2", {"w_intra": 2}), ("intra w8", {"w_intra": 8}), ("prep w8", {"w_prep": 8}),
                ("prep bk64", {"bk_prep": 64}), ("rec bv64", {"bv_rec": 64}), ("rec w8", {"w_rec": 8}),
                ("rec st3", {"stages_rec": 3}), ("intra bk64", {"bk_intra": 64})]
    if quick:
        variants = variants[:3]
    x = inputs(1, 32768, 32, 128, seed=0)
    do = torch.randn_like(x["v"])
    for name, over in variants:
        if time.time() - T0 > ARGS.budget:
            print("time budget: sweep stops at", name)
            break
        KB.TUNING.clear()
        KB.TUNING.update(base, **over)
        row = {"section": "sweep", "variant": name, "over": over}
        try:
            per_kernel(x, -5.0, do, n=1)                # compile
            row["kernels_ms"] = per_kernel(x, -5.0, do)
            row["total_ms"] = sum(row["kernels_ms"].values())
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    KB.TUNING.clear()
    KB.TUNING.update(base)


def print_tables(rows):
    print("\n== accuracy (rel err vs fp32 reference; fla's tolerance 8e-3)")
    for r in rows:
        if r["section"] == "accuracy":
            for who in ("ours", "fla"):
                if who in r:
                    print(f"{r['gate']:9} {who:5} " + " ".join(f"{n}={r[who][n]:.1e}" for n in NAMES))
    print("\n== fwd+bwd (median ms)")
    print(f"{'B,T,H,D':>16} {'gate':9} {'ours f+b':>9} {'fwd':>7} {'bwd':>7} {'fla f+b':>8} {'fla/ours':>8}  "
          "max rel vs fla")
    for r in rows:
        if r["section"] == "time":
            mx = max(r["rel_vs_fla"].values()) if "rel_vs_fla" in r else float("nan")
            print(f"{','.join(map(str, r['shape'])):>16} {r['gate']:9} {r.get('ours_fb_ms', float('nan')):9.2f} "
                  f"{r.get('ours_fwd_ms', float('nan')):7.2f} {r.get('ours_bwd_ms', float('nan')):7.2f} "
                  f"{r.get('fla_fb_ms', float('nan')):8.2f} {r.get('fla_over_ours', float('nan')):8.2f}  {mx:.1e}"
                  + (f"  ERR {r['ours_error'][:80]}" if "ours_error" in r else ""))
            if "kernels_ms" in r:
                print(" " * 27 + "  ".join(f"{k} {v:.2f}" for k, v in r["kernels_ms"].items()))
    print("\n== backward sweep (B1 T32768 H32 K3; ms per launch)")
    for r in rows:
        if r["section"] == "sweep":
            if "kernels_ms" in r:
                print(f"{r['variant']:12} total {r['total_ms']:7.2f}  "
                      + "  ".join(f"{k} {v:.2f}" for k, v in r["kernels_ms"].items()))
            else:
                print(f"{r['variant']:12} ERR {r.get('error', '')[:100]}")
    print("\n== registers")
    for r in rows:
        if r["section"] == "regs":
            print(f"{r['kernel']:28} regs {r['regs']:>4} spills {r['spills']:>5} smem {r['smem']:>7} "
                  f"warps {r['warps']} stages {r['stages']}")


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kda_bwd.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sections", default="accuracy,time,regs,sweep")
    ARGS = ap.parse_args()
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 - run ours alone
        print("fla not importable:", repr(e)[:200])
        chunk_kda = None
    rows: list = []
    shapes = [((1, 32768, 32, 128), "k3", -5.0), ((1, 32768, 32, 128), "softplus", None),
              ((8, 4096, 32, 128), "k3", -5.0)]
    if ARGS.quick:
        shapes = shapes[:1]
    secs = ARGS.sections.split(",")
    for s in ("accuracy", "time", "regs", "sweep"):
        if s not in secs:
            continue
        print(f"==== {s} ({time.time() - T0:.0f} s)", flush=True)
        try:
            if s == "accuracy":
                section_accuracy(rows, chunk_kda)
            elif s == "time":
                section_time(rows, chunk_kda, shapes)
            elif s == "regs":
                section_regs(rows)
            else:
                section_sweep(rows, ARGS.quick)
        except Exception:  # noqa: BLE001 - go on to the next section
            traceback.print_exc()
        torch.cuda.empty_cache()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
            with open(ARGS.out, "w") as f:
                json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "elapsed_s": time.time() - T0}, f,
                          indent=1)
        except OSError as e:
            print("could not write", ARGS.out, e)
    if "regs" in secs:      # again at the end: the sweep compiled more variants
        rows[:] = [r for r in rows if r["section"] != "regs"]
        try:
            section_regs(rows)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print_tables(rows)
    with open(ARGS.out, "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "elapsed_s": time.time() - T0}, f, indent=1)


ARGS = None
if __name__ == "__main__":
    main()
