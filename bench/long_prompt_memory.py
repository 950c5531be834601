"""Peak memory of a long-prompt prefill on the torch target (CPU): one fresh subprocess per prompt length T
loads k3-tiny (random init), compiles it for torch float32 and prefills T random tokens, through
``Session.prefill`` (segments of ``--chunk`` tokens, state carried) or through the serving engine
(``--via engine``: pool blocks of ``--block`` tokens, one request with ``max_tokens`` 1). Each child reports
its peak resident set (``ru_maxrss``) and the prefill's seconds; the parent prints a table last and writes
``bench/results/long_prompt_memory/<date>-<commit>.json`` (``-engine`` before ``.json`` for the engine path). Linearity rule
(bench/SERVING.md), per token: from 16k tokens on, each step's growth per extra token is at most 1.1 x the
previous step's, ``(peak(64k) - peak(32k)) / 32k <= 1.1 x (peak(32k) - peak(16k)) / 16k`` (linear memory keeps
the bytes per extra token constant; a quadratic term doubles them from one doubling of T to the next).

    python bench/long_prompt_memory.py                       # T = 1k .. 64k, Session.prefill, 1 thread
    python bench/long_prompt_memory.py --lengths 1024 65536 --via engine
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def child(T: int, via: str, chunk: int, block: int, threads: int) -> dict:
    import resource

    import numpy as np
    import torch
    from k3ir.runtime import Session
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.sampler import SamplingParams

    import k3ir
    torch.set_num_threads(threads)
    m = k3ir.load("k3-tiny")
    ids = np.random.default_rng(T).integers(0, 256, (1, T))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if via == "session":
        s = Session(k3ir.compile(m, target="torch", dtype="float32"), seed=0, prefill_chunk=chunk)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        logits, state = s.prefill(ids)
        ok = bool(torch.isfinite(logits[0, -1]).all()) and state.length == T
    else:
        eng = build_engine(m, seed=0, block_size=block, num_blocks=T // block + 2, max_batch=1)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        (req,) = eng.generate([ids[0].tolist()], SamplingParams(max_tokens=1))
        ok = req.finish_reason in ("length", "stop") and len(req.output) == 1
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"T": T, "via": via, "peak_rss_mib": peak / 1024, "before_prefill_mib": base / 1024,
            "prefill_s": secs, "ok": ok}


def per_token_rule(peak: dict, start: int = 16384) -> dict | None:
    """The linearity rule on ``peak`` (T -> peak MiB, None where the child failed): the growth per extra token
    (KiB) of each step between consecutive lengths from ``start`` on, and ``linear``: no step's per-token growth
    above 1.1 x the previous step's. None with fewer than three measured lengths from ``start``."""
    ts = sorted(t for t, p in peak.items() if t >= start and p)
    if len(ts) < 3:
        return None
    steps = list(itertools.pairwise(ts))
    kib = [(peak[b] - peak[a]) * 1024 / (b - a) for a, b in steps]
    return {"steps": steps, "per_token_kib": kib, "linear": all(k2 <= 1.1 * k1 for k1, k2 in itertools.pairwise(kib))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--via", choices=("session", "engine"), default="session")
    ap.add_argument("--chunk", type=int, default=2048, help="Session.prefill segment (default 2048)")
    ap.add_argument("--block", type=int, default=2048, help="engine pool block in tokens (default 2048)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child (default 1)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.via, a.chunk, a.block, a.threads)))
        return 0
    sys.path.insert(0, HERE)
    from benchlib import git_commit, print_table
    rows = []
    for T in a.lengths:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(T), "--via", a.via, "--chunk", str(a.chunk),
               "--block", str(a.block), "--threads", str(a.threads)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if out.returncode:
            rows.append({"T": T, "via": a.via, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    peak = {r["T"]: r.get("peak_rss_mib") for r in rows}
    rule = per_token_rule(peak)
    commit = git_commit()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "via": a.via, "chunk": a.chunk, "block": a.block, "threads": a.threads, "rows": rows, "rule": rule}
    out_dir = os.path.join(HERE, "results", "long_prompt_memory")
    os.makedirs(out_dir, exist_ok=True)
    suffix = "" if a.via == "session" else f"-{a.via}"
    path = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{commit}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    if rule:
        steps = ", ".join(f"{a}->{b}: {k:.2f}" for (a, b), k in zip(rule["steps"], rule["per_token_kib"]))
        print(f"linearity per token (KiB per extra token, {steps}): each step <= 1.1 x the previous: {rule['linear']}")
    print_table(["T", "peak RSS (MiB)", "before prefill (MiB)", "prefill (s)", "ok"],
                [[r["T"], f"{r['peak_rss_mib']:.1f}" if "peak_rss_mib" in r else None,
                  f"{r['before_prefill_mib']:.1f}" if "before_prefill_mib" in r else None,
                  f"{r['prefill_s']:.1f}" if "prefill_s" in r else None, r.get("ok", r.get("error"))] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
