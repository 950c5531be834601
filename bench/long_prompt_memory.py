"""Peak memory of a long-prompt prefill on a CPU target (``--target``: torch, the default; onnx; tvm, alias
tvm-llvm; triton under ``TRITON_INTERPRET=1``, set for its children): one fresh subprocess per prompt length T
loads k3-tiny (random init), compiles it for the target in float32 and prefills T random tokens, through
``Session.prefill`` (segments of ``--chunk`` tokens, state carried) or through the serving engine
(``--via engine``: pool blocks of ``--block`` tokens, prompt segments of at most ``--prefill-tokens``, one
request with ``max_tokens`` 1, temperature 0). Targets other than torch build their runtime lazily (onnxruntime
sessions, TVM's Relax build on first call): their child first runs the same path on a 64-token prompt, so the
compile is done before the "before prefill" reading (the peak still counts it: ``ru_maxrss`` is the whole
process's). Each child runs ``--threads`` threads (torch's, the onnxruntime session's ``intra_op_num_threads``,
``TVM_NUM_THREADS``) and reports its peak resident set (``ru_maxrss``, MiB), the peak of the measured prefill
alone (``VmHWM`` after resetting it through ``/proc/self/clear_refs`` just before the prefill, and the resident
set then; None where the kernel refuses the reset), the prefill's seconds, its pid and the greedy next token
(argmax of the last logits). The parent prints a table last and writes
``bench/results/long_prompt_memory/<date>-<commit>[-<target>][-engine].json`` (or ``--out``) with the machine,
``uptime`` before and after and the command. Linearity rule (bench/SERVING.md), per token: from 16k tokens on,
each step's growth per extra token is at most 1.1 x the previous step's,
``(peak(64k) - peak(32k)) / 32k <= 1.1 x (peak(32k) - peak(16k)) / 16k`` (linear memory keeps the bytes per extra
token constant; a quadratic term doubles them from one doubling of T to the next).

    python bench/long_prompt_memory.py                       # T = 1k .. 64k, Session.prefill, 1 thread
    python bench/long_prompt_memory.py --lengths 1024 65536 --via engine
    python bench/long_prompt_memory.py --target onnx --via engine --lengths 1024 2048 4096 8192 16384
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


TARGETS = ("torch", "onnx", "tvm", "tvm-llvm", "triton")
WARMUP_T = 64          # the warm-up prompt of targets that compile on first call (one KDA chunk)


def _reset_peak() -> bool:
    """Reset this process's ``VmHWM`` (Linux ``clear_refs`` value 5); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_mib() -> float | None:
    """``VmHWM`` of this process (peak resident set since start or the last reset), MiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def child(T: int, target: str, via: str, chunk: int, block: int, threads: int, prefill_tokens: int) -> dict:
    """Prefill T random ids on ``target`` in this (fresh) process; the row of the table (MiB, seconds)."""
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
    warm = np.random.default_rng(0).integers(0, 256, (1, WARMUP_T))
    if via == "session":
        runner = Session(k3ir.compile(m, target=target, dtype="float32"), seed=0, prefill_chunk=chunk)
        exe = runner.exe
    else:
        runner = build_engine(m, target=target, dtype="float32", seed=0, block_size=block,
                              num_blocks=T // block + 3, max_batch=1,
                              max_prefill_tokens=prefill_tokens)
        exe = runner.session.exe
    if target == "onnx":
        exe.threads = threads                   # read when its onnxruntime sessions are built (first call)

    def prefill(x):
        """(ok, the greedy next token) of a prefill of ``x``."""
        if via == "session":
            logits, state = runner.prefill(x)
            last = np.asarray(logits[0, -1], dtype=np.float64)
            return bool(np.isfinite(last).all()) and state.length == x.shape[1], int(last.argmax())
        (req,) = runner.generate([x[0].tolist()], SamplingParams(max_tokens=1, temperature=0))
        return req.finish_reason in ("length", "stop") and len(req.output) == 1, int(req.output[0])

    if target != "torch":
        prefill(warm)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss0 = _vm_hwm_mib() if _reset_peak() else None      # right after the reset: the resident set now
    t0 = time.perf_counter()
    ok, token = prefill(ids)
    secs = time.perf_counter() - t0
    hwm = _vm_hwm_mib() if rss0 is not None else None       # first: ru_maxrss read after it is at least as large
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"T": T, "target": target, "via": via, "pid": os.getpid(), "next_token": token, "peak_rss_mib": peak / 1024,
            "before_prefill_mib": base / 1024, "rss_at_prefill_mib": rss0, "prefill_peak_mib": hwm,
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


def machine() -> dict:
    """CPU model, logical CPUs usable here, memory (MiB), Python and torch versions."""
    import platform
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            info["mem_total_mib"] = int(f.readline().split()[1]) // 1024
    except OSError:
        pass
    return info


def uptime() -> str:
    """``uptime``'s line (the load averages), or the load averages alone where there is no ``uptime``."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    ap.add_argument("--target", choices=TARGETS, default="torch", help="compile target (default torch)")
    ap.add_argument("--via", choices=("session", "engine"), default="session")
    ap.add_argument("--chunk", type=int, default=2048, help="Session.prefill segment (default 2048)")
    ap.add_argument("--block", type=int, default=2048, help="engine pool block in tokens (default 2048)")
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="engine's max_prefill_tokens: the longest prompt segment of one step (default 4096)")
    ap.add_argument("--threads", type=int, default=1, help="threads per child (default 1)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/long_prompt_memory/...)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.target, a.via, a.chunk, a.block, a.threads, a.prefill_tokens)))
        return 0
    sys.path.insert(0, HERE)
    from benchlib import git_commit, print_table
    env = dict(os.environ, TVM_NUM_THREADS=str(a.threads))
    if a.target == "triton":
        env["TRITON_INTERPRET"] = "1"           # read when triton is imported: set before the child starts
    load_start, rows = uptime(), []
    for T in a.lengths:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(T), "--target", a.target, "--via", a.via,
               "--chunk", str(a.chunk), "--block", str(a.block), "--prefill-tokens", str(a.prefill_tokens), "--threads", str(a.threads)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        if out.returncode:
            rows.append({"T": T, "target": a.target, "via": a.via, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    peak = {r["T"]: r.get("peak_rss_mib") for r in rows}
    rule = per_token_rule(peak)
    commit = git_commit()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "command": " ".join(["python bench/long_prompt_memory.py --target", a.target, "--via", a.via, "--lengths",
                                   *map(str, a.lengths), "--chunk", str(a.chunk), "--block", str(a.block),
                                   "--prefill-tokens", str(a.prefill_tokens), "--threads", str(a.threads)]),
              "machine": machine(), "uptime_start": load_start, "uptime_end": uptime(),
              "target": a.target, "via": a.via, "chunk": a.chunk, "block": a.block,
              "prefill_tokens": a.prefill_tokens, "threads": a.threads,
              "rows": rows, "rule": rule}
    path = a.out
    if path is None:
        out_dir = os.path.join(HERE, "results", "long_prompt_memory")
        os.makedirs(out_dir, exist_ok=True)
        suffix = ("" if a.target == "torch" else f"-{a.target}") + ("" if a.via == "session" else f"-{a.via}")
        path = os.path.join(out_dir, f"{datetime.date.today().isoformat()}-{commit}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    if rule:
        steps = ", ".join(f"{a}->{b}: {k:.2f}" for (a, b), k in zip(rule["steps"], rule["per_token_kib"]))
        print(f"linearity per token (KiB per extra token, {steps}): each step <= 1.1 x the previous: {rule['linear']}")

    def mib(r, key):
        return f"{r[key]:.1f}" if r.get(key) is not None else None

    print_table(["T", "peak RSS (MiB)", "before prefill (MiB)", "prefill peak (MiB)", "prefill (s)", "ok"],
                [[r["T"], mib(r, "peak_rss_mib"), mib(r, "before_prefill_mib"), mib(r, "prefill_peak_mib"),
                  f"{r['prefill_s']:.2f}" if "prefill_s" in r else None, r.get("ok", r.get("error"))] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
