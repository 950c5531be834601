"""The 300-step k3-tiny training benchmark: `k3ir train` once per balancing rule (quantile, sign,
none), then a table of loss and worst-layer max/mean load. Results go to bench/TRAINING.md by hand.

    python bench/train_k3_tiny.py --out /tmp/k3train            # sequential, on this machine
    python bench/train_k3_tiny.py --out /tmp/k3train --pin      # parallel, each run pinned to its
                                                                # own 2 cores (a many-core machine)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="k3train-bench")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rules", default="quantile,sign,none")
    ap.add_argument("--pin", action="store_true", help="run all rules at once, each on 2 cores (taskset)")
    ap.add_argument("--extra", default="", help="extra arguments for k3ir train")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rules = a.rules.split(",")
    procs = {}
    for i, rule in enumerate(rules):
        cmd = [sys.executable, "-m", "k3ir.cli", "train", "--steps", str(a.steps), "--qb", rule,
               "--out", str(out / rule), "--log-every", "25", "--threads", "2", *a.extra.split()]
        if a.pin and shutil.which("taskset"):
            cmd = ["taskset", "-c", f"{2 * i},{2 * i + 1}", *cmd]
        log = open(out / f"{rule}.log", "w")  # noqa: SIM115 (closed after the run)
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="2"))
        procs[rule] = (p, t0, log)
        if not a.pin:
            p.wait()
            procs[rule] = (p, t0, log, time.perf_counter() - t0)
    rows = []
    for rule in rules:
        item = procs[rule]
        p, t0, log = item[:3]
        p.wait()
        wall = item[3] if len(item) > 3 else time.perf_counter() - t0
        log.close()
        s = json.loads((out / rule / "training.json").read_text())
        rows.append((rule, s, wall))
    print("| qb | loss step 1 | loss step 100 | loss step 200 | final loss (mean last 10) | held-out loss | "
          "worst max/mean load (mean last 20) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for rule, s, wall in rows:
        L = s["loss"]
        print(f"| {rule} | {L[0]:.3f} | {L[min(99, len(L) - 1)]:.3f} | {L[min(199, len(L) - 1)]:.3f} | "
              f"{s['final_loss_10']:.3f} | {s['eval_loss']:.3f} | {s['worst_balance_20']:.3f} | {wall:.0f} |")
    print(f"ln(256) = {math.log(256):.4f}")
    for rule, s, _ in rows:
        print(rule, "per-layer max/mean (mean of last 20 steps):",
              {k: round(v, 3) for k, v in s["per_layer_balance_20"].items()})
        print(rule, "loss every 25 steps:", [round(x, 3) for x in s["loss"][::25]] + [round(s["loss"][-1], 3)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
