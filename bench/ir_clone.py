"""Module.clone of a bundled model against the print-then-parse round trip it replaced, in one process.

    python bench/ir_clone.py [--model kimi-k3] [--repeats 5] [--out PATH]

Times ``Module.clone()`` (structural: a value map) and ``parse_module(print_module(m))`` on the same module,
``--repeats`` times each, interleaved; prints a table (median, min, max in seconds; ratio of the medians) and writes
JSON (default ``bench/results/ir_clone/<date>-<commit>.json``). Both copies must print identically (checked).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from benchlib import git_commit, result_path

import k3ir
from k3ir.parser import parse_module
from k3ir.printer import print_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-k3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    m = k3ir.load(args.model)
    ops = sum(len(f.ops) for f in m.functions.values())
    text = print_module(m)
    assert print_module(m.clone()) == text and print_module(parse_module(text)) == text
    times = {"clone": [], "print_parse": []}
    for _ in range(args.repeats):
        for name, fn in (("clone", m.clone), ("print_parse", lambda: parse_module(print_module(m)))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    stats = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in times.items()}
    report = {"model": args.model, "ops": ops, "commit": git_commit(), "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": stats,
              "ratio_print_parse_over_clone": stats["print_parse"]["median"] / stats["clone"]["median"]}
    with open(args.out or result_path("ir_clone"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{args.model}: {ops} ops, {args.repeats} repeats each, interleaved")
    print(f"{'method':<14} {'median s':>9} {'min s':>8} {'max s':>8}")
    for k, s in stats.items():
        print(f"{k:<14} {s['median']:>9.3f} {s['min']:>8.3f} {s['max']:>8.3f}")
    print(f"print+parse / clone (medians): {report['ratio_print_parse_over_clone']:.1f}x")


if __name__ == "__main__":
    main()
