"""Whole-model correctness on the GPU (issue 6): triton vs torch target on the same weights, same dtype,
batch 2: a 37-token prefill, then 3 decode steps fed their own state (decode as the CUDA graph unless
the case says ``eager``). Relative error per SPEC 11. Each case runs in its own process, all cases in
parallel (a cold Triton cache makes compilation, which is CPU work, the bulk of the time), each printing
one JSON row per step as soon as it is computed, so a timeout still leaves every finished number.

    python3 bench/gpu_model_check.py [--budget 60] [--cases k3-tiny:float32,...] [--speed 'ARGS']
    TRITON_INTERPRET=1 python bench/gpu_model_check.py --tiny --out /tmp/check.json   # CPU check of the script

``--speed 'ARGS'`` also starts ``bench/bench_models.py ARGS`` in parallel and tells it (``--wait-file``) when the
checks are over, so its timings are not shared with the checks' GPU work. ``--tiny``: one case (k3-tiny float32),
no decode-compile helper. Writes ``--out`` (default ``bench/results/gpu_model_check/<date>-<commit>.json``: meta
and the rows); exit 1 on a miss or an error.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

KL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
      "intermediate_size": 512, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
      "mlp_layer_types": ["dense"] + ["sparse"] * 3,
      "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 2,
                             "short_conv_kernel_size": 4}}
MODELS = {"k3-tiny": ("k3-tiny", None), "kimi-linear-small": ("kimi-linear-6p6b", KL)}
TOL = {"float32": 2e-3, "bfloat16": 5e-2}        # TF32 dots in float32; bf16 rounding + routing flips
#: most important first; ``:eager`` decodes without the CUDA graph (bisects capture vs kernels on a miss)
DEFAULT_CASES = "k3-tiny:float32,kimi-linear-small:float32,kimi-linear-small:bfloat16,k3-tiny:float32:eager"
T0 = time.time()


def emit(**r):
    r["t_s"] = round(time.time() - T0, 1)
    print("ROW " + json.dumps(r), flush=True)


def rel(a, b) -> float:
    import torch
    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30))


def run_case(case: str, deadline: float, warm: bool = False) -> int:
    """One (model, dtype[, eager]) case in this process; rows printed as they come. ``warm``: only compile
    its decode kernels (a helper process started alongside, so prefill and decode compile in parallel)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    import torch
    from bench_models import n_compiled
    from k3ir.runtime import Session

    import k3ir
    key, dt, *flags = case.split(":")
    name, ov = MODELS[key]
    tol = TOL[dt]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = k3ir.load(name, ov)
    tri = Session(k3ir.compile(m, target="triton", dtype=dt, device=dev))
    if "eager" in flags:
        tri.exe.cuda_graphs = False
    if warm:        # helper: compile the decode kernels into the on-disk cache from a zero state of 37 tokens
        from bench_models import _zero_state
        t = time.time()
        st = _zero_state(tri, 2, 37)
        for step in range(2):
            _, st = tri.decode(np.array([[5 + step], [17 + step]]), st)
        if dev == "cuda":
            torch.cuda.synchronize()
        emit(case=case, step="prewarm", s=round(time.time() - t, 1), compiled=n_compiled())
        return 0
    ref = Session(k3ir.compile(m, target="torch", dtype=dt, device=dev))
    ids = np.random.default_rng(0).integers(0, 250, (2, 37))
    want, s_ref = ref.prefill(ids)
    t = time.time()
    got, s_tri = tri.prefill(ids)
    if dev == "cuda":
        torch.cuda.synchronize()
    e = rel(got, want)
    emit(case=case, step="prefill", rel=e, tol=tol, ok=e < tol, first_call_s=round(time.time() - t, 1),
         compiled=n_compiled())
    bad = e >= tol
    for step in range(3):
        if time.time() > deadline:
            emit(case=case, step=f"decode{step + 1}", error="time guard")
            return 1
        nxt = np.array([[5 + step], [17 + step]])
        want, s_ref = ref.decode(nxt, s_ref)
        t = time.time()
        got, s_tri = tri.decode(nxt, s_tri)
        if dev == "cuda":
            torch.cuda.synchronize()
        e = rel(got, want)
        bad |= e >= tol
        emit(case=case, step=f"decode{step + 1}", rel=e, tol=tol, ok=e < tol, call_s=round(time.time() - t, 1),
             compiled=n_compiled(), graph=bool(getattr(tri.exe, "_graph", None) is not None and tri.exe._graph.graph is not None))
    return int(bad)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for all cases (children killed after)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--speed", default="", help="arguments for bench/bench_models.py, run alongside")
    ap.add_argument("--no-prewarm", action="store_true", help="no decode-compile helper process per case")
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="one case, no helper (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/gpu_model_check/<date>-<commit>.json)")
    a = ap.parse_args()
    if a.case:
        try:
            return run_case(a.case, a.deadline or time.time() + a.budget, a.warm)
        except Exception as e:      # noqa: BLE001 - one line, the parent goes on
            emit(case=a.case, step="error", error=f"{type(e).__name__}: {str(e)[:300]}")
            return 1
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchlib import Report, result_path
    rep = Report("gpu_model_check", a.out or result_path("gpu_model_check"), sys.argv)
    if a.tiny:
        a.cases, a.no_prewarm = "k3-tiny:float32", True
    deadline = time.time() + a.budget
    import tempfile
    wait_file = os.path.join(tempfile.mkdtemp(prefix="gpu_model_check_"), "checks_done")
    if os.path.exists(wait_file):
        os.remove(wait_file)
    here = os.path.dirname(os.path.abspath(__file__))
    speed = None
    if a.speed:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        speed = subprocess.Popen([sys.executable, os.path.join(here, "bench_models.py"), *a.speed.split(),
                                  "--wait-file", wait_file], env=env)
    rows, procs, threads = [], [], []

    def pump(p, case):
        for line in p.stdout:
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(f"[check] {line[4:].rstrip()}", flush=True)
            elif line.strip():
                print(f"[{case}] {line.rstrip()[:400]}", flush=True)
    def stop(signum, frame):        # an outer `timeout` must not leave the children running
        for _, p in procs:
            p.kill()
        if speed is not None:
            speed.kill()
        sys.exit(124)
    signal.signal(signal.SIGTERM, stop)
    cases = a.cases.split(",")
    jobs = [(c, False) for c in cases] + ([] if a.no_prewarm else [(c, True) for c in cases])
    for case, warm in jobs:
        p = subprocess.Popen([sys.executable, __file__, "--case", case, "--deadline", str(deadline - 2)]
                             + (["--warm"] if warm else []),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append((case, p))
        th = threading.Thread(target=pump, args=(p, case + (" warm" if warm else "")), daemon=True)
        th.start()
        threads.append(th)
    for (case, p), (_, warm) in zip(procs, jobs):
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            if not warm:
                rows.append({"case": case, "step": "killed", "error": f"over the {a.budget:.0f} s budget"})
                print(f"[check] {case}: killed at the budget", flush=True)
    for th in threads:
        th.join(timeout=2)
    open(wait_file, "w").close()
    rep.data["rows"] = rows
    rep.write()
    bad = sum(1 for r in rows if r.get("error") or r.get("ok") is False)
    print(f"\n{'case':<34} {'step':<9} {'rel err':>10} {'tol':>7}  result")
    for r in rows:
        res = r.get("error") or ("info" if "ok" not in r else "ok" if r["ok"] else "MISS")
        print(f"{r['case']:<34} {r['step']:<9} {r.get('rel', float('nan')):>10.2e} {r.get('tol', 0):>7.0e}  {res}")
    from k3ir.backends.triton.config import get_triton_config
    print(f"checks: {len(rows)} rows, {bad} bad, {time.time() - T0:.0f} s; CUDA graphs "
          f"{get_triton_config().decode.cuda_graphs}", flush=True)
    if speed is not None:
        try:
            speed.wait(timeout=None)
        except KeyboardInterrupt:
            speed.kill()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
