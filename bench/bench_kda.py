"""KDA kernels of the triton target against fla on one GPU, every baseline in the same process and run, on the same
inputs, 3 interleaved repeats (median, min-max), the copy bandwidth and matmul rate measured first (the floors'
ceilings). Modes (one JSON each, default ``bench/results/<benchmark>/<date>-<commit>.json``, or ``--out``):

- ``--compare`` (the default): the forward (``kda_forward``, shipped TritonConfig) vs fla ``chunk_kda`` (K3 gate:
  ``safe_gate=True, lower_bound=-5``; softplus: fla's default gate; gate, q/k L2 norm and beta sigmoid in the
  kernel) at (1,32768,32,128), (8,4096,32,128), (1,8192,96,128), (1,8192,64,128); benchmark ``kda_forward``.
- ``--decode``: one decode step (``kda_decode``, K3 gate, state pool updated in place) vs fla
  ``fused_recurrent_kda`` (same gate options, the same initial state) at H 32 and 96, B 1/64/256, both as CUDA
  graph replays; benchmark ``kda_decode``.
- ``--sweep``: ``TritonConfig.kda`` variants of the forward (tuning; single medians, no ratios); ``kda_sweep``.
Forward+backward: ``bench/bench_kda_bwd.py``. ``--warm`` runs each case of the mode once (compiles, fla autotune),
times nothing and writes nothing: ``bench/gpu_verification.py`` starts it in parallel processes before the timed run.

    python3 bench/bench_kda.py [--compare] [--shapes "1,8192,64,128;..."]
    python3 bench/bench_kda.py --decode
    TRITON_INTERPRET=1 python bench/bench_kda.py --compare --tiny --out /tmp/kda.json      # CPU check of the script
    TRITON_INTERPRET=1 python bench/bench_kda.py --decode --tiny --out /tmp/kda_dec.json
    python3 bench/bench_kda.py --sweep --no-fla --budget 15 --variants default --shapes 1,32768,32,128  # ~20 s
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEV = "cuda"     # "cpu" without a GPU (--tiny under the interpreter)
#: the ceilings measured at the start of this run (``benchlib.Report.ceilings``): copy bytes/s, matmul FLOP/s
CEIL = {"copy_Bps": None, "matmul_flops": None}
DECODE_H = [32, 96]
DECODE_B = [1, 64, 256]


def bench(fn, graph=False, rep=200):
    import triton.testing as tt
    if graph:
        try:
            return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        except Exception as e:  # noqa: BLE001 - not capturable (host syncs): time with events instead
            print("no CUDA graph:", repr(e)[:80])
    return float(tt.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def wall(fn, n=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return sorted(ts)[len(ts) // 2]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def fwd_cost(B, T, H, D):
    """Floor bytes (read q,k,v,g bf16 + beta, write o) and chunked-form FLOPs (chunk 64)."""
    n = B * T * H
    bytes_ = n * D * 2 * 5 + n * 2
    flops = n * (4 * 2 * 64 * D + 3 * 2 * D * D + 2 * 64 * D)
    return bytes_, flops


def inputs(B, T, H, D, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, device=DEV, generator=g).to(dt)
    return {"q": r(B, T, H, D), "k": r(B, T, H, D), "v": r(B, T, H, D), "g": r(B, T, H, D), "beta": r(B, T, H),
                "A_log": (torch.rand(H, device=DEV, generator=g) * 2 - 1).float(),
                "dt_bias": r(H * D, dt=torch.float32)}


def _ours_fwd(fn, x, lb, **kw):
    def run():
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], lower_bound=lb,
                  output_final_state=True, **kw)
    return run


def _fla_fwd(chunk_kda, x, lb):
    kw = {"safe_gate": True, "lower_bound": lb} if lb is not None else {}

    def run():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                         use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         output_final_state=True, **kw)
    return run


# ---- --sweep: forward variants of TritonConfig.kda, per launch, registers/spills, errors ----------------
SWEEP_SHAPES = [(1, 32768, 32, 128)]                 # default + every variant, both gates
SWEEP_EXTRA = [(8, 4096, 32, 128), (1, 8192, 96, 128)]  # default only
#: (name, TritonConfig.kda overrides, only this gate or None); the first is the default. See docs/config.md.
VARIANTS = [
    ("default", {}, None),       # inverse split on 1 warp, tf32 dots; softplus akk BK 32 under the 128 cap
    ("next", {"gcum_mode": "rows", "fast_log": True, "wu_mode": "flat", "diag_main": True}, None),  # all together
    ("next_w4", {"gcum_mode": "rows", "fast_log": True, "wu_mode": "flat", "warps": 4, "bk": 16, "exact_bk": 16},
     None),                                     # ... with akk on 4 warps, BK 16 (no diag_main: it spills there)
    ("akk_w4_bk16", {"warps": 4, "bk": 16, "exact_bk": 16}, None),  # split inverse: 123 regs, 4 CTAs/SM, -15% instr.
    ("akk_w4", {"warps": 4, "exact_bk": 16}, None),   # K3 BK32 on 4 warps: -29% instructions, 8 B spill
    ("akk_w2", {"warps": 2}, "k3"),            # 2 warps: -47% instructions, 164 regs (6 CTAs of 2 warps per SM)
    ("akk_s2", {"stages": 2, "maxnreg": 128}, "k3"),   # K3 akk loads pipelined (cp.async): 128 regs, 48 B spill
    ("akk_bk64", {"bk": 64}, "k3"),           # session 4: K3 akk BK 64 on 4 warps: 168 regs (3 CTAs/SM), -7.5% instr.
    ("gcum_rows", {"gcum_mode": "rows"}, None),  # gate cumsum as a per-thread running sum (offline 4-6x fewer instr.)
    ("rows_fastlog", {"gcum_mode": "rows", "fast_log": True}, "softplus"),  # ... and lg2.approx for the log
    ("wu_flat", {"wu_mode": "flat"}, None),   # w/u: one program per slice, all loads at once (4 CTAs/SM)
    ("sp_diag_main", {"diag_main": True}, "softplus"),   # softplus diagonal blocks in the strip dot (span <= 80)
    ("wu_flat_xbio", {"wu_mode": "flat", "xb": "io"}, None),   # ... with Xb in bf16 (as fla's Akk inverse)
    ("wu_prefetch", {"wu_prefetch": True}, None),  # w/u loops unrolled, loads one slice ahead (2 CTAs/SM)
    ("inv_akk_fp32", {"inv": "akk", "inv_prec": "ieee", "inv_warps": 4, "exact_bk": 16}, None),  # the 01:50 default
    ("inv_split_fp32", {"inv_prec": "ieee", "inv_warps": 4}, None),   # split inverse, fp32 dots on 4 warps
    ("sp_bk16", {"exact_bk": 16}, "softplus"),       # softplus akk in 16-column slices
    ("recur_bv16", {"bv": 16}, None),          # recurrence BV 16: 256 programs at B1 H32 (2 per SM)
    ("recur_w8", {"recur_warps": 8}, None),
    ("wu_flat_w8", {"wu_flat_warps": 8}, None),
    ("recur_bv32", {"bv": 32}, None),          # recurrence BV 32 at N*H >= 128 too (use with --shapes 8,4096,32,128)
    ("no_gcum", {"gcum": False}, None),        # the gate cumsum recomputed inside akk and wu (the 00:58 design)
    # session 4: softplus akk on the K3 code path (diagonal blocks in the strip dots around min(Gs, Ge + 80) per
    # channel; channels with a 16-row span > clamp_thr left out of the dots and added exactly in a rarely taken
    # branch, 0.4% of the sub-chunks here): offline (Triton 3.6, sm_90a) 4 warps BK32 under the 128 cap: 128 regs,
    # 56 B spill (stores/loads between the strips only, none in the K loops); K3 akk 27.2k warp-instr. per program,
    # sp_clamp's main path ~32k; the recurrence on 3 stages (132 regs, 188 kB smem; the backward's fwd_h went
    # 1.12 -> 0.90 ms with 3 stages)
    ("sp_clamp", {"sp_clamp": True}, "softplus"),
    ("sp_clamp_nocap", {"sp_clamp": True, "clamp_maxnreg": None}, "softplus"),   # 206 regs (2 CTAs/SM)
    ("sp_clamp_w8", {"sp_clamp": True, "clamp_warps": 8}, "softplus"),       # 164 regs, 0 B spill (1 CTA/SM)
    ("sp_clamp_bk64", {"sp_clamp": True, "clamp_bk": 64, "clamp_maxnreg": None}, "softplus"),  # 224 regs
    ("wu64_w8", {"wu_bk": 64, "wu_bv": 64, "wu_flat_warps": 8}, None),   # flat w/u, 64-wide slices: Xb read 4x
    ("recur_s3", {"recur_stages": 3}, None),
    ("s4", {"sp_clamp": True, "recur_stages": 3}, None),    # both (K3: recur_s3 alone)
    # session 4, H96: the recurrence is a serial chain of chunk steps on 1 CTA/SM (3 stages: 134 regs, 188 kB at
    # BV 32; 240 regs, 205 kB at BV 64; H200 steps ~1.49 us at BV 32, 1.82 at BV 64), so it costs ceil(programs /
    # 132) waves x chunks x step: (1,8192,96,128) BV 32 = 384 programs, 3 waves (0.583 ms); BV 64 = 192, 2 waves
    # (pred. ~0.47); B1 T32768 H32 keeps BV 32 (128 programs, 1 wave; BV 64 pred. 0.93 vs 0.75)
    ("recur_waves", {"bv_rule": "waves"}, None),        # kda.recur_block "waves": BV 64 at N*H 96 / 64, 32 at 32
    ("recur_bv64", {"bv": 64}, "k3"),                   # BV 64 everywhere (loses at N*H = 32)
    ("recur_s1", {"recur_stages": 1}, "k3"),            # BV 32, 1 stage: 156 regs, 64 kB: 3 CTAs/SM = 396 slots
    ("recur_bv64_s1", {"bv": 64, "recur_stages": 1}, "k3"),   # BV 64, 1 stage: 255 regs, 72 kB: 2 CTAs/SM
    ("recur_bv16_s1", {"bv": 16, "recur_stages": 1}, "k3"),   # BV 16, 1 stage: 126 regs, 60 kB: 3 CTAs/SM
    ("recur_waves_w8", {"bv_rule": "waves", "recur_warps": 8}, "k3"),   # BV 64 on 8 warps: 203 regs, 205 kB
    # "waves" over 3-stage and 1-stage configs (guessed 1-stage step costs: 1.8 at 3 CTAs/SM, 2.0 at 2): (32, 1) at
    # N*H 96 (= recur_s1 there), (32, 3) at N*H 32 (= default); set the costs from recur_s1 / recur_bv64_s1
    # the K3 akk at H 96 compiles to 140 registers (3 CTAs of 4 warps per SM; 26.4k warp-instructions) where H 32
    # gets 128 (4 CTAs; 27.2k): capped at 128 it is H 32's code at H 96 too (offline Triton 3.6: 128 regs, 0 spill,
    # 27.2k instr.), pred. akk 1.080 -> ~0.98 ms at (1,8192,96,128); no change at H 32
    ("akk_cap128", {"maxnreg": 128}, "k3"),
    ("h96", {"bv_rule": "waves", "maxnreg": 128}, None),    # akk_cap128 + recur_waves (softplus: recur_waves only)
    ("recur_occ", {"bv_rule": "waves", "recur_table": ((32, 3, 1, 1.0), (64, 3, 1, 1.22), (32, 1, 3, 1.8),
                                                       (64, 1, 2, 2.0))}, None),
]


def stage_bytes(B, T, H, D):
    """Bytes each launch must move at least (bf16 io, fp32 Xb; L2 re-reads not counted), per call."""
    n = B * T * H
    return {"gcum": n * D * (2 + 4), "inv": n * 64 * 4 * 2,
            "akk": n * (2 * D * 2 + D * 4 + 2 + 64 * 2 + 64 * 4 + 8),
            "wu": n * (3 * D * 2 + D * 4 + 64 * 4 + 8 + 4 * D * 2),
            "recur": n * (3 * D * 2 + 64 * 2 + D * 2 + D * 2)}


def _regs(seen):
    """Registers/spills of the KDA forward kernels compiled since the last call."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes"))
    from gpu_diag import compiled_kernels
    from k3ir.backends.triton.kda import fwd as kda_kernels
    from k3ir.backends.triton.kda import fwd_intra as kda_fwd_kernels
    out = []
    for mod in (kda_fwd_kernels, kda_kernels):
        for name, ck in compiled_kernels(mod):
            if id(ck) in seen:
                continue
            seen.add(id(ck))
            md = ck.metadata
            out.append({"kernel": name, "regs": getattr(ck, "n_regs", -1), "spill": getattr(ck, "n_spills", -1),
                        "smem": getattr(md, "shared", -1), "warps": getattr(md, "num_warps", -1),
                        "stages": getattr(md, "num_stages", -1)})
    return out


def sweep_rows(args, rows, save, kda_forward_kernels, chunk_kda):
    """Phase 1: the default at every sweep shape and gate (fla timed unless --no-fla: one median each, beside ours,
    no ratio); phase 2: every variant at SWEEP_SHAPES (both gates per variant), while ``--budget`` seconds last
    (a variant is started only if ~8 s of budget are left: compiling akk costs most of that)."""
    from k3ir.backends.triton.config import get_triton_config, triton_config
    t0 = time.time()
    seen = set()
    gates = (("k3", -5.0), ("softplus", None))
    refs = {}

    def one(x, shape, gate, lb, name, over, ref_o, fla_o):
        scope = triton_config(kda=over)
        scope.__enter__()
        row = {"kind": "variant", "variant": name, "shape": list(shape), "gate": gate, "tuning": over}
        try:
            t = time.time()
            o, _ = _ours_fwd(kda_forward_kernels, x, lb)()
            torch.cuda.synchronize()
            row["first_call_s"] = time.time() - t
            row["regs"] = _regs(seen)
            row["ours_ms"] = bench(_ours_fwd(kda_forward_kernels, x, lb), rep=args.rep)
            tun = get_triton_config().kda
            if tun.intra == "fused":
                launches = ("intra", "recur")
            else:
                launches = ((("gcum",) if tun.gcum else ()) + ("akk",)
                            + (("inv",) if tun.inv == "split" else ()) + ("wu", "recur"))
            nb = stage_bytes(*shape)
            if name != "default" and args.variant_launches:
                keep = args.variant_launches.split(",")
                launches = tuple(st for st in launches if st in keep)
            for st in launches:
                ms = bench(_ours_fwd(kda_forward_kernels, x, lb, stages=(st,)), rep=args.rep)
                row[f"{st}_ms"] = ms
                if st in nb:
                    row[f"{st}_mem_frac"] = nb[st] / CEIL["copy_Bps"] / (ms * 1e-3)
            row["finite"] = bool(torch.isfinite(o).all())
            if ref_o is not None:
                row["err_vs_default_o"] = rel(o, ref_o)
            if fla_o is not None:
                row["err_vs_fla_o"] = rel(o, fla_o)
            row["fla_ms"] = refs.get((tuple(shape), gate, "fla_ms"))     # this run's single median (no ratio:
            nbytes, flops = fwd_cost(*shape)                             # a tuning sweep; --compare for ratios)
            row.update(mem_frac=nbytes / CEIL["copy_Bps"] / (row["ours_ms"] * 1e-3),
                       flop_frac=flops / CEIL["matmul_flops"] / (row["ours_ms"] * 1e-3), t_s=time.time() - t0)
            del o
        except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
            row["error"] = repr(e)[:300]
        scope.__exit__(None, None, None)
        print(row, flush=True)
        rows.append(row)
        save()
        return row

    shapes = args.shapes or SWEEP_SHAPES
    extra = [] if args.shapes else SWEEP_EXTRA
    names = set(args.variants.split(",")) if args.variants else None
    gates = tuple(gt for gt in gates if args.gates in ("both", gt[0]))
    variants = [v for v in VARIANTS[1:] if names is None or v[0] in names]
    if names is not None:
        order = args.variants.split(",")
        variants.sort(key=lambda v: order.index(v[0]))
    if args.all_shapes:
        first = set((args.first_only or "").split(","))
        jobs = [(shape, [v]) for v in variants for shape in shapes + extra if v[0] not in first or shape == shapes[0]]
    else:
        jobs = [(shapes[0], variants)] if variants else []
    if args.precompile:
        specs = [(shape, gate, "default") for shape in shapes + extra for gate, _ in _gates_of(shape, gates)]
        specs += [(shape, gate, name) for shape, vs in jobs for name, _, only in vs
                  for gate, _ in _gates_of(shape, gates) if only in (None, gate)]
        precompile(specs, args.precompile, min(18.0, max(5.0, args.budget * 0.45)))
        print(f"precompiled {len(specs)} configs in {time.time() - t0:.1f} s", flush=True)
    # phase 1: defaults (and fla unless --no-fla)
    for shape in shapes + extra:
        x = inputs(*shape)
        for gate, lb in _gates_of(shape, gates):
            fla_o = None
            if chunk_kda is not None:
                try:
                    fla = _fla_fwd(chunk_kda, x, lb)
                    fla_o = fla()[0]
                    refs[(tuple(shape), gate, "fla_ms")] = bench(fla, rep=args.rep)
                except Exception as e:  # noqa: BLE001
                    print("fla failed:", repr(e)[:200])
            r = one(x, shape, gate, lb, "default", {}, None, fla_o)
            refs[(tuple(shape), gate)] = (r, fla_o, None)
        del x
        torch.cuda.empty_cache()
    # phase 2: variants in list order (--variants order when given), both gates each (gate-specific ones only for
    # their gate); --all-shapes: each variant at every shape before the next variant
    for shape, vs in jobs:
        x = inputs(*shape)
        ref = {}
        sgates = _gates_of(shape, gates)
        for gate, lb in sgates:
            if not any(only in (None, gate) for _, _, only in vs):
                continue
            try:
                ref[gate] = _ours_fwd(kda_forward_kernels, x, lb)()[0]
            except Exception as e:  # noqa: BLE001
                print("default failed:", repr(e)[:200])
                ref[gate] = None
        for name, over, only in vs:
            for gate, lb in sgates:
                if only is not None and only != gate:
                    continue
                if time.time() - t0 > args.budget - args.margin:
                    print(f"budget of {args.budget} s used: skipping {name} {shape} {gate}", flush=True)
                    continue
                one(x, shape, gate, lb, name, over, ref[gate], refs.get((tuple(shape), gate), (None, None))[1])
        del x, ref
        torch.cuda.empty_cache()


def precompile(specs, jobs, timeout):
    """``--precompile N``: compile every (shape, gate, variant) of the sweep in up to N parallel processes (a
    ``--warm`` forward at T = 128 each: T is not specialised, so the binaries are those of the full shapes) into
    Triton's on-disk cache, so the sweep's first calls load instead of compiling one kernel after the other
    (~3-7 s per akk variant). Failures and the ``timeout`` (s) are reported, not fatal: the sweep then compiles."""
    import subprocess
    import tempfile
    todo = [f"{sh[0]},{sh[2]},{sh[3]}|{gate}|{name}" for sh, gate, name in dict.fromkeys(specs)]
    t_end = time.time() + timeout
    running = []
    while todo or running:
        while todo and len(running) < jobs:
            spec = todo.pop(0)
            err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed when its process ends
            running.append((spec, err, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm-variant", spec],
                                                        stdout=subprocess.DEVNULL, stderr=err)))
        time.sleep(0.05)
        for job in list(running):
            spec, err, pr = job
            if pr.poll() is None and time.time() < t_end:
                continue
            if pr.poll() is None:
                pr.kill()
                pr.wait()
                print(f"precompile {spec}: timed out", flush=True)
            elif pr.returncode:
                err.seek(0)
                print(f"precompile {spec}: rc {pr.returncode} {err.read()[-300:]!r}", flush=True)
            err.close()
            running.remove(job)
        if time.time() >= t_end:
            todo = []


def warm(spec):
    """``--warm-variant B,H,D|gate|variant``: one forward at T = 128 with that variant's TritonConfig.kda (fills Triton's cache)."""
    from k3ir.backends.triton.config import triton_config
    from k3ir.backends.triton.kda.chunk import kda_forward_kernels
    dims, gate, name = spec.split("|")
    B, H, D = (int(n) for n in dims.split(","))
    with triton_config(kda={n: o for n, o, _ in VARIANTS}[name]):
        _ours_fwd(kda_forward_kernels, inputs(B, 128, H, D), -5.0 if gate == "k3" else None)()
    if DEV == "cuda":
        torch.cuda.synchronize()


ACC_CASES = ("sp_strong", "sp_mid", "sp_varlen", "k3", "softplus")   # most telling first (budget)
ACC_SHAPE, ACC_CU = (1, 1000, 32, 128), [0, 1, 64, 65, 1100, 2048]    # --acc sizes (varlen: B1, T = ACC_CU[-1];
#                                                                      H 32 reuses the sweep's binaries)
ACC_DTYPE = torch.bfloat16


def _acc_inputs(case, seed=5):
    """Inputs of one ``--acc`` case (bf16, B1 T1000 H32 D128 with an initial state; varlen: B1 T2048, five
    sequences): the bench gates, softplus with 16-row decay spans ~1000 on half the channels (``sp_strong``: the
    exact fix-up path) or ~80-117 (``sp_mid``: the clamped reference), varlen with the strong gates."""
    B, T, H, D = (1, ACC_CU[-1], *ACC_SHAPE[2:]) if case == "sp_varlen" else ACC_SHAPE
    x = inputs(B, T, H, D, seed=seed, dtype=ACC_DTYPE)
    cu = ACC_CU if case == "sp_varlen" else None
    db = x["dt_bias"].reshape(H, D)
    if case in ("sp_strong", "sp_varlen"):
        x["A_log"] = torch.full_like(x["A_log"], 2.5)
        db[:, : D // 2] = db[:, : D // 2] * 3 + 6
        db[:, D // 2:] = db[:, D // 2:] - 4
    elif case == "sp_mid":
        x["A_log"] = torch.zeros_like(x["A_log"])
        db.mul_(0.3).add_(6.0)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x["h0"] = torch.randn(len(cu) - 1 if cu else B, H, D, D, device=DEV, generator=g)
    return x, (-5.0 if case == "k3" else None), cu


def _ref64(x, lb, cu):
    """float64 token recurrence on the GPU (the torch backend's ``kda_reference64``), per sequence."""
    from k3ir.backends.torch.ops import kda_reference64
    return kda_reference64(*(x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")), lower_bound=lb,
                           initial_state=x["h0"], cu_seqlens=cu)


def acc_rows(args, rows, save, kda_forward_kernels):
    """``--acc``: the default and the ``--variants`` against a float64 reference (bf16 inputs; fla's tolerance
    5e-3 on o and the final state), finiteness included, for ``ACC_CASES``; ``--acc-budget`` seconds."""
    from k3ir.backends.triton.config import triton_config
    names = ["default"] + [n for n in (args.acc_variants or args.variants or "").split(",") if n and n != "default"]
    var = {n: (o, only) for n, o, only in VARIANTS}
    t0 = time.time()
    for case in ACC_CASES:
        if time.time() - t0 > args.acc_budget:
            print(f"acc budget used: skipping {case}", flush=True)
            continue
        try:
            x, lb, cu = _acc_inputs(case)
            o_r, s_r = _ref64(x, lb, cu)
        except Exception as e:  # noqa: BLE001
            rows.append({"kind": "acc", "case": case, "error": repr(e)[:300]})
            continue
        gate = "k3" if lb is not None else "softplus"
        for name in names:
            over, only = var.get(name, ({}, None))
            if only is not None and only != gate:
                continue
            scope = triton_config(kda=over)
            scope.__enter__()
            row = {"kind": "acc", "case": case, "variant": name, "gate": gate}
            try:
                o, st = kda_forward_kernels(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                            lower_bound=lb, initial_state=x["h0"], output_final_state=True,
                                            cu_seqlens=None if cu is None else torch.tensor(cu, device=DEV))
                if DEV == "cuda":
                    torch.cuda.synchronize()
                row.update(err_o=rel(o, o_r), err_state=rel(st, s_r),
                           finite=bool(torch.isfinite(o).all() and torch.isfinite(st).all()))
                row["ok"] = row["finite"] and row["err_o"] < 5e-3 and row["err_state"] < 5e-3
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            scope.__exit__(None, None, None)
            print(row, flush=True)
            rows.append(row)
            save()


def print_acc(rows):
    acc = [r for r in rows if r.get("kind") == "acc"]
    if acc:
        print(f"\n{'acc case':10} {'variant':14} {'err o':>8} {'err state':>9} {'finite':>6} {'ok':>3}")
    for r in acc:
        if "error" in r:
            print(f"{r['case']:10} {r.get('variant', '-'):14} ERROR {r['error'][:120]}")
            continue
        print(f"{r['case']:10} {r['variant']:14} {r['err_o']:8.1e} {r['err_state']:9.1e} {r['finite']!s:>6} "
              f"{'ok' if r['ok'] else 'BAD':>3}")


def print_sweep(rows):
    print(f"\n{'variant':14} {'B,T,H,D':>16} {'gate':8} {'ours ms':>8} {'fla ms':>7} "
          f"{'gcum ms':>7} {'akk ms':>7} {'inv ms':>7} {'wu ms':>7} {'recur ms':>8} {'akk mem%':>8} {'wu mem%':>7} "
          f"{'err dflt':>8} {'err fla':>8}")
    for r in rows:
        if r.get("kind") != "variant":
            continue
        if "error" in r:
            print(f"{r['variant']:14} {','.join(map(str, r['shape'])):>16} {r['gate']:8} ERROR {r['error'][:120]}")
            continue
        intra = _fmt(r, "akk_ms", "{:7.3f}") if "akk_ms" in r else _fmt(r, "intra_ms", "{:7.3f}")
        shp = ",".join(map(str, r["shape"]))
        print(f"{r['variant']:14} {shp:>16} {r['gate']:8} {_fmt(r, 'ours_ms', '{:8.3f}')} "
              f"{_fmt(r, 'fla_ms', '{:7.3f}')} {_fmt(r, 'gcum_ms', '{:7.3f}'):>7} "
              f"{intra:>7} {_fmt(r, 'inv_ms', '{:7.3f}'):>7} "
              f"{_fmt(r, 'wu_ms', '{:7.3f}'):>7} "
              f"{_fmt(r, 'recur_ms', '{:8.3f}')} {_fmt(r, 'akk_mem_frac', '{:8.1%}')} "
              f"{_fmt(r, 'wu_mem_frac', '{:7.1%}')} {_fmt(r, 'err_vs_default_o', '{:8.1e}')} "
              f"{_fmt(r, 'err_vs_fla_o', '{:8.1e}')}")
    print(f"\n{'variant':14} {'gate':8} {'kernel':22} {'regs':>5} {'spill B':>8} {'smem B':>7} {'warps':>5} "
          f"{'stages':>6}")
    for r in rows:
        for k in r.get("regs", []):
            print(f"{r['variant']:14} {r['gate']:8} {k['kernel']:22} {k['regs']:>5} {k['spill']:>8} {k['smem']:>7} "
                  f"{k['warps']:>5} {k['stages']:>6}")


def _fmt(r, k, fmt):
    v = r.get(k)
    return fmt.format(v) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


#: --shapes "B,T,H,D@gate": that shape runs only that gate (filled by ``_shapes``)
SHAPE_GATES: dict = {}


def _shapes(text):
    out = []
    try:
        for part in (p.strip() for p in text.split(";")):
            if not part:
                continue
            dims, _, gate = part.partition("@")
            out.append(tuple(int(n) for n in dims.split(",")))
            if gate:
                if gate not in ("k3", "softplus"):
                    out = []
                    break
                SHAPE_GATES[out[-1]] = gate
    except ValueError:
        out = []
    if not out or any(len(sh) != 4 for sh in out):
        raise argparse.ArgumentTypeError(f"shapes must be B,T,H,D[@k3|@softplus][;...], got {text!r}")
    return out


def _gates_of(shape, gates):
    """The (gate, lower bound) pairs that run at ``shape`` (``--shapes ...@gate`` restricts one shape)."""
    only = SHAPE_GATES.get(tuple(shape))
    return tuple(gt for gt in gates if only is None or gt[0] == only)



# ---- --compare: the forward against fla in the same process, interleaved repeats, measured ceilings -----------
CMP_SHAPES = [(1, 32768, 32, 128), (8, 4096, 32, 128), (1, 8192, 96, 128), (1, 8192, 64, 128)]
TINY_SHAPES = [(1, 130, 2, 32), (2, 64, 2, 32)]      # --tiny: the CPU interpreter (TRITON_INTERPRET=1)
FLA_KW = {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}


def compare_rows(args):
    """``--compare``: ours (``k3ir.backends.triton.kda_forward``, the shipped TritonConfig) against fla ``chunk_kda`` (K3
    gate: ``safe_gate=True, lower_bound=-5``; softplus: fla's default gate; gate, q/k L2 norm and beta sigmoid in the
    kernel; both with the final state; as a diagnostic also ``kda_forward_kernels(..., check_gates=False)``, ours
    without the host-side NaN scan of g and its sync) on the same bf16 inputs at ``CMP_SHAPES`` (``--tiny``: ``TINY_SHAPES`` in
    float32 under the interpreter), ``--repeats`` interleaved ``do_bench`` medians each; the output (o) and final
    state error of each against the other; the copy bandwidth and bf16 matmul rate measured first, and our time
    against the bytes / FLOPs floors at those. Without fla its columns are empty (noted in the JSON). Writes
    ``--out`` after every row; prints a table last."""
    import inspect

    from benchlib import Report, fmt_ms, interleaved, print_table
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.kda.chunk import kda_forward_kernels
    rep = Report("kda_forward", args.out, sys.argv)
    if not args.warm:
        rep.ceilings()
        CEIL.update(copy_Bps=rep.copy_Bps, matmul_flops=rep.matmul_flops)
    chunk_kda, fla_skip = None, "--no-fla"
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001 - fla missing or broken: our rows only
            fla_skip = f"fla not importable: {e!r}"[:300]
    rep.data["meta"]["fla_note"] = None if chunk_kda is not None else fla_skip
    if chunk_kda is None:
        print(f"fla rows skipped: {fla_skip}", flush=True)
    import importlib.util
    rep.data["meta"]["flash_kda_package"] = importlib.util.find_spec("flash_kda") is not None   # fla's CUTLASS path
    dtype = torch.float32 if args.tiny else torch.bfloat16
    for shape in args.shapes or (TINY_SHAPES if args.tiny else CMP_SHAPES):
        x = inputs(*shape, dtype=dtype)
        for gate, lb in (("k3", -5.0), ("softplus", None)):
            row = {"kind": "fwd", "shape": list(shape), "gate": gate, "dtype": str(dtype)[6:],
                   "fla_skipped": None if chunk_kda is not None else fla_skip}
            fns = {"ours": _ours_fwd(kda_forward, x, lb)}
            if "check_gates" in inspect.signature(kda_forward_kernels).parameters:   # diagnostic: the same
                fns["ours_no_gate_check"] = _ours_fwd(kda_forward_kernels, x, lb, check_gates=False)  # without the
                #                                           host-side NaN scan of g and its sync (not the headline)
            t0 = time.time()
            o1, s1 = fns["ours"]()
            row["ours_first_call_s"] = time.time() - t0
            if chunk_kda is not None:
                kw = {"safe_gate": True, "lower_bound": lb} if lb is not None else {}

                def fla(kw=kw, x=x):
                    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                     dt_bias=x["dt_bias"], output_final_state=True, **FLA_KW, **kw)
                t0 = time.time()
                try:
                    o2, s2 = fla()
                    row["fla_first_call_s"] = time.time() - t0
                    fns["fla"] = fla
                    row.update(err_ours_vs_fla_o=rel(o1, o2), err_fla_vs_ours_o=rel(o2, o1),
                               err_ours_vs_fla_state=rel(s1, s2), err_fla_vs_ours_state=rel(s2, s1),
                               fla_finite=bool(torch.isfinite(o2).all()))
                    del o2, s2
                except Exception as e:  # noqa: BLE001 - recorded, ours still timed
                    row["fla_error"] = repr(e)[:300]
            row["ours_finite"] = bool(torch.isfinite(o1).all() and torch.isfinite(s1).all())
            del o1, s1
            if args.warm:               # compiled (and fla autotuned) into the caches: nothing timed or written
                print(f"warm {shape} {gate}: ours {row['ours_first_call_s']:.1f} s, fla "
                      f"{row.get('fla_first_call_s', '-')} s", flush=True)
                continue
            t = interleaved(fns, args.repeats, rep_ms=200)
            nbytes, flops = fwd_cost(*shape)
            med = t["ours"]["median"] * 1e-3
            row.update(ours_ms=t["ours"], fla_ms=t.get("fla"), ours_no_gate_check_ms=t.get("ours_no_gate_check"),
                       ratio_fla_over_ours=t["fla"]["median"] / t["ours"]["median"] if "fla" in t else None,
                       floor_ms=max(nbytes / rep.copy_Bps, flops / rep.matmul_flops) * 1e3,
                       mem_frac=nbytes / rep.copy_Bps / med, flop_frac=flops / rep.matmul_flops / med)
            rep.add(row)
        del x
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if args.warm:
        return
    m = rep.data["meta"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, fla {m.get('fla')}, commit {m['commit']}, "
          f"{m['date']}; K3IR_* switches: {m['env_switches'] or 'none'}")
    lines = []
    for r in rep.data["rows"]:
        ratio = r["ratio_fla_over_ours"]
        lines.append([",".join(map(str, r["shape"])), r["gate"], fmt_ms(r["ours_ms"]), fmt_ms(r["fla_ms"]),
                      None if ratio is None else f"{ratio:.3f}", f"{r['mem_frac']:.1%}", f"{r['flop_frac']:.1%}",
                      _fmt(r, "err_ours_vs_fla_o", "{:.1e}"), _fmt(r, "err_fla_vs_ours_o", "{:.1e}")])
    print_table(["B,T,H,D", "gate", "ours ms (min-max)", "fla ms (min-max)", "fla/ours", "mem %", "flop %",
                 "o err ours vs fla", "o err fla vs ours"], lines)


def decode_rows(args):
    """``--decode``: one decode step of ``kda_decode`` (K3 gate, ``lower_bound=-5``; q/k L2 norm, beta sigmoid and the
    gate in the launch; the state pool ``[B, H, D, D]`` fp32 updated in place through ``slots``) against fla
    ``fused_recurrent_kda`` (the same gate options, ``initial_state`` = the same state, final state returned: fla
    writes a new tensor where ours writes the pool: the same bytes) at H in ``DECODE_H``, B in ``DECODE_B``, D 128
    (``--tiny``: H 2, D 32, B 1/3 in float32). Both as CUDA-graph replays (events when capture fails: recorded per
    row), ``--repeats`` interleaved; output and state error of ours against fla from the same state; floor = the state
    read + written and q, k, v, g, o over the measured copy bandwidth. JSON ``kda_decode``; table last."""
    from benchlib import Report, fmt_ms, interleaved, print_table
    from k3ir.backends.triton import kda_decode
    rep = Report("kda_decode", args.out, sys.argv)
    if not args.warm:
        rep.ceilings()
    frk, fla_skip = None, "--no-fla"
    if not args.no_fla:
        try:
            from fla.ops.kda import fused_recurrent_kda as frk
        except Exception as e:  # noqa: BLE001 - fla missing or broken: our rows only
            fla_skip = f"fla not importable: {e!r}"[:300]
    rep.data["meta"]["fla_note"] = None if frk is not None else fla_skip
    dtype = torch.float32 if args.tiny else torch.bfloat16
    D = 32 if args.tiny else 128
    graph = DEV == "cuda"
    for H in ((2,) if args.tiny else DECODE_H):
        for B in ((1, 3) if args.tiny else DECODE_B):
            x = inputs(B, 1, H, D, seed=B * 1000 + H, dtype=dtype)
            g = torch.Generator(device=DEV).manual_seed(B + H)
            S = torch.randn(B, H, D, D, device=DEV, generator=g) * 0.1
            pool = S.clone()
            slots = torch.arange(B, device=DEV, dtype=torch.int32)
            qf, kf, vf, zf = (x[n].reshape(B, H * D) for n in ("q", "k", "v", "g"))
            bf = x["beta"].reshape(B, H)

            def ours(qf=qf, kf=kf, vf=vf, zf=zf, bf=bf, x=x, pool=pool, slots=slots):
                return kda_decode(qf, kf, vf, zf, bf, x["A_log"], x["dt_bias"], pool, slots, lower_bound=-5.0)
            row = {"kind": "decode", "shape": [B, 1, H, D], "gate": "k3", "dtype": str(dtype)[6:], "graph": graph,
                   "fla_skipped": None if frk is not None else fla_skip}
            o1 = ours()
            s1 = pool.clone()
            fns = {"ours": ours}
            if frk is not None:
                st = S.clone()

                def fla(x=x, st=st):
                    return frk(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                               initial_state=st, output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
                try:
                    o2, s2 = fla()
                    row.update(err_ours_vs_fla_o=rel(o1, o2.reshape(B, H * D)), err_ours_vs_fla_state=rel(s1, s2),
                               fla_finite=bool(torch.isfinite(o2).all()))
                    fns["fla"] = fla
                except Exception as e:  # noqa: BLE001 - recorded, ours still timed
                    row["fla_error"] = repr(e)[:300]
            row["ours_finite"] = bool(torch.isfinite(o1).all() and torch.isfinite(s1).all())
            if args.warm:
                continue
            t = interleaved(fns, args.repeats, rep_ms=100, graph=graph)
            nbytes = 2 * B * H * D * D * 4 + 5 * B * H * D * x["q"].element_size()
            med = t["ours"]["median"] * 1e-3
            row.update(ours_ms=t["ours"], fla_ms=t.get("fla"),
                       ratio_fla_over_ours=t["fla"]["median"] / t["ours"]["median"] if "fla" in t else None,
                       floor_ms=nbytes / rep.copy_Bps * 1e3, mem_frac=nbytes / rep.copy_Bps / med,
                       flop_frac=8 * B * H * D * D / rep.matmul_flops / med)
            rep.add(row)
            del x, S, pool
    if args.warm:
        return
    m = rep.data["meta"]
    print(f"\n{m['gpu']}, torch {m['torch']}, triton {m['triton']}, fla {m.get('fla')}, commit {m['commit']}, "
          f"{m['date']}; K3IR_* switches: {m['env_switches'] or 'none'}")
    print_table(["B,T,H,D", "ours ms (min-max)", "fla ms (min-max)", "fla/ours", "mem %", "o err vs fla"],
                [[",".join(map(str, r["shape"])), fmt_ms(r["ours_ms"]), fmt_ms(r["fla_ms"]),
                  None if r["ratio_fla_over_ours"] is None else f"{r['ratio_fla_over_ours']:.3f}",
                  f"{r['mem_frac']:.1%}", _fmt(r, "err_ours_vs_fla_o", "{:.1e}")] for r in rep.data["rows"]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/<kda_forward | kda_decode | "
                                                "kda_sweep>/<date>-<commit>.json)")
    ap.add_argument("--compare", action="store_true", help="the forward vs fla (the default mode)")
    ap.add_argument("--decode", action="store_true", help="one decode step vs fla fused_recurrent_kda")
    ap.add_argument("--sweep", action="store_true", help="forward variants of TritonConfig.kda only (see VARIANTS)")
    ap.add_argument("--warm", action="store_true", help="run each case once (compile, fla autotune); no timing, no JSON")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per candidate, interleaved")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--no-fla", action="store_true", help="do not import or time fla (its columns stay empty)")
    ap.add_argument("--shapes", default=None, type=_shapes,
                    help="B,T,H,D[@gate][;B,T,H,D...]: --compare: these shapes; --sweep: instead of the sweep shapes "
                         "(variants on the first unless --all-shapes; '@k3' / '@softplus': that gate only)")
    ap.add_argument("--budget", type=float, default=110.0, help="--sweep: seconds before variants are skipped")
    ap.add_argument("--margin", type=float, default=8.0,
                    help="--sweep: a variant row starts only while this many seconds of --budget are left (8: an "
                         "akk compile; recurrence-only variants compile in ~0.5 s)")
    ap.add_argument("--first-only", default=None,
                    help="--sweep --all-shapes: comma-separated variants that run at the first shape only")
    ap.add_argument("--variant-launches", default=None,
                    help="--sweep: per-launch times of the variants for these launches only (e.g. akk,wu,recur; "
                         "the defaults always time every launch)")
    ap.add_argument("--rep", type=int, default=60, help="--sweep: timing window per measurement (ms)")
    ap.add_argument("--variants", default=None,
                    help="--sweep: comma-separated VARIANTS names to run after the defaults ('default': none)")
    ap.add_argument("--gates", default="both", choices=("both", "k3", "softplus"), help="--sweep: gates to run")
    ap.add_argument("--all-shapes", action="store_true", help="--sweep: the variants at every shape, not the first")
    ap.add_argument("--acc", action="store_true",
                    help="--sweep: then the default and --variants against a float64 reference (ACC_CASES)")
    ap.add_argument("--acc-budget", type=float, default=20.0, help="--acc: seconds before cases are skipped")
    ap.add_argument("--acc-variants", default=None, help="--acc: variants to check (default: --variants)")
    ap.add_argument("--precompile", type=int, default=0,
                    help="--sweep: compile the sweep's configs first in up to N parallel processes (Triton cache)")
    ap.add_argument("--warm-variant", default=None, help=argparse.SUPPRESS)   # precompile's worker: B,H,D|gate|variant
    args = ap.parse_args()
    if args.compare + args.decode + args.sweep > 1:
        ap.error("choose one of --compare, --decode, --sweep")
    mode = "decode" if args.decode else "sweep" if args.sweep else "compare"
    if args.out is None:
        from benchlib import result_path
        args.out = result_path({"compare": "kda_forward", "decode": "kda_decode", "sweep": "kda_sweep"}[mode])
    global DEV
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if args.warm_variant:
        warm(args.warm_variant)
        return
    if mode == "compare":
        compare_rows(args)
        return
    if mode == "decode":
        decode_rows(args)
        return
    if DEV != "cuda":
        ap.error("--sweep needs a CUDA GPU (it reads compiled kernels' registers)")
    from benchlib import Report
    from k3ir.backends.triton.kda.chunk import kda_forward_kernels
    rep = Report("kda_sweep", args.out, sys.argv)
    rep.ceilings()
    CEIL.update(copy_Bps=rep.copy_Bps, matmul_flops=rep.matmul_flops)
    chunk_kda = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001 - fla missing or broken: our numbers only
            rep.data["meta"]["fla_note"] = f"fla not importable: {e!r}"[:300]
    rows = rep.data["rows"]

    def save():
        rep.write()

    try:
        sweep_rows(args, rows, save, kda_forward_kernels, chunk_kda)
        if args.acc:
            acc_rows(args, rows, save, kda_forward_kernels)
    finally:
        print(f"\n{rep.data['meta']}")
        print_sweep(rows)
        print_acc(rows)
        save()


if __name__ == "__main__":
    main()
