"""CPU tokens/s of the export routes of one model side by side in ONE process, same random weights, same tokens:
torch eager (its default pipeline: the baseline), the ONNX exports run by onnxruntime (opset 20 with KDA as a
``Scan``; opset 27 with the standard ``LinearAttention``/``CausalConvWithState``; opset 27 with ``--ort-kernels``;
the routed experts as expert-sorted slices, the default, or as the ``Loop`` over experts) and, with ``--mlir``,
IREE llvm-cpu (the ``mlir`` target: ``mlir``, chunked KDA and sorted MoE, the default; ``mlir-scan-dense``, the
earlier lowering kept behind ``MlirConfig(kda_form="scan", moe_form="dense")``). On request (``--variants``):
``mlir-bf16`` (``MlirConfig(weights="bf16")``: bf16 weight arguments, so its logits differ from torch's by the bf16
rounding of the random weights) and ``mlir-mxfp4`` (routed experts packed as MXFP4, ``--quantize mxfp4``: its
logits differ by the quantisation).

    python bench/onnx_export.py                       # k3-100m, T=128, 16 decode steps
    python bench/onnx_export.py --variants torch,onnx27-ort,onnx20 --T 64

Prefill: T tokens, batch 1; decode: ``--steps`` greedy steps after a T-token prefill, tokens/s = steps / wall time.
Every session is built and warmed up first (IREE compiles then, not in the timings); then 3 repeats interleaved
(each variant once per round, so load from other processes spreads over all of them). onnxruntime's threads do not
spin between runs (``session.intra_op.allow_spinning=0``), so they leave the cores to the next variant's pool;
run with ``OMP_WAIT_POLICY=PASSIVE`` for torch's OpenMP threads likewise. Reported: median, min and max
per variant; ratios divide medians of the same run. The JSON (``bench/results/onnx_export/<date>-<commit>.json``)
also holds each variant's prefill-logit error against torch's (float32 both) and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import git_commit, result_path
from cpu_backends import K3_100M
from k3ir.runtime import Session
from k3ir.runtime.params import init_param

import k3ir

MODELS = {"k3-tiny": ("k3-tiny", None), "k3-100m": ("k3-tiny", K3_100M)}
#: variant -> (target, settings: onnx (opset, ort_kernels, moe_form) or MlirConfig changes)
VARIANTS = {
    "torch": ("torch", None),
    "onnx27-ort": ("onnx", (27, True, "sorted")),
    "onnx27-ort-moeloop": ("onnx", (27, True, "loop")),
    "onnx27-std": ("onnx", (27, False, "sorted")),
    "onnx20": ("onnx", (20, False, "sorted")),
    "onnx20-moeloop": ("onnx", (20, False, "loop")),
    "mlir": ("mlir", {}),
    "mlir-scan-dense": ("mlir", {"kda_form": "scan", "moe_form": "dense"}),
    "mlir-bf16": ("mlir", {"weights": "bf16"}),
    "mlir-mxfp4": ("mlir", {"passes": ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]}),
}
MLIR_VARIANTS = ("mlir", "mlir-scan-dense")
DEFAULT = "torch,onnx27-ort,onnx27-ort-moeloop,onnx27-std,onnx20,onnx20-moeloop"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def make_session(m, variant: str, params: dict) -> tuple[Session, float]:
    """A Session of ``variant`` on ``params``; returns it and its build seconds (IREE compiles here)."""
    target, settings = VARIANTS[variant]
    t = time.perf_counter()
    if target == "mlir":                      # built, weighted, emitted and compiled now, under its MlirConfig
        from k3ir.backends.mlir.config import mlir_config
        with mlir_config(**{k: v for k, v in settings.items() if k != "passes"}):
            exe = k3ir.compile(m, target=target, dtype="float32", passes=settings.get("passes"))
            if "passes" in settings:          # MXFP4: packed from the same float weights
                from k3ir.passes.quantize_experts import materialize
                params = {**params, **materialize(exe.module, lambda name, _t: params[name])}
            s = Session(exe, params={n: params[n] for n in exe.module.params})
            exe.compile_group(("prefill", "decode"))
        return s, time.perf_counter() - t
    exe = k3ir.compile(m, target=target, dtype="float32")
    if target == "onnx":
        exe.opset, exe.ort_kernels, exe.moe_form = settings
        exe.session_config = {"session.intra_op.allow_spinning": "0"}   # no spinning beside torch's and IREE's pools
    return Session(exe, params=params), time.perf_counter() - t


def prefill_seconds(s: Session, ids) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    logits, _ = s.prefill(ids)
    return time.perf_counter() - t, np.asarray(logits, dtype=np.float64)


def decode_seconds(s: Session, ids, steps: int) -> float:
    """Wall seconds of ``steps`` greedy decode steps after a (not timed) prefill of ``ids``."""
    logits, state = s.prefill(ids)
    tok = np.asarray(logits)[:, -1:].argmax(-1)
    t = time.perf_counter()
    for _ in range(steps):
        logits, state = s.decode(tok, state)
        tok = np.asarray(logits)[:, -1:].argmax(-1)
    return time.perf_counter() - t


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="k3-100m", choices=sorted(MODELS))
    ap.add_argument("--variants", default=DEFAULT, help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--mlir", action="store_true", help="add the mlir (IREE llvm-cpu) variants")
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/onnx_export/<date>-<commit>.json)")
    a = ap.parse_args()
    variants = a.variants.split(",") + ([v for v in MLIR_VARIANTS if v not in a.variants.split(",")] if a.mlir else [])
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (have {', '.join(VARIANTS)})")
    name, over = MODELS[a.model]
    m = k3ir.load(name, over)
    params = {n: init_param(m.params[n]) for n in m.params}
    ids = np.random.default_rng(0).integers(0, 256, size=(1, a.T))
    load_before = load_average()
    sessions, build = {}, {}
    for v in variants:
        sessions[v], build[v] = make_session(m, v, params)
        prefill_seconds(sessions[v], ids)                                     # warm-up
        decode_seconds(sessions[v], ids[:, :8], 2)
        print(f"built {v} in {build[v]:.1f} s", file=sys.stderr, flush=True)
    pre = {v: [] for v in variants}
    dec = {v: [] for v in variants}
    logits = {}
    for _ in range(a.repeats):                                                # interleaved repeats
        for v in variants:
            sec, logits[v] = prefill_seconds(sessions[v], ids)
            pre[v].append(a.T / sec)
        for v in variants:
            dec[v].append(a.steps / decode_seconds(sessions[v], ids, a.steps))
    ref = logits.get("torch")
    rows = []
    for v in variants:
        err = None if ref is None else float(np.linalg.norm(logits[v] - ref) / np.linalg.norm(ref))
        rows.append({"variant": v, "target": VARIANTS[v][0], "onnx": VARIANTS[v][1], "build_s": build[v],
                     "prefill_tok_s": stats(pre[v]), "decode_tok_s": stats(dec[v]), "logits_rel_err_vs_torch": err})
    med = {v: (statistics.median(pre[v]), statistics.median(dec[v])) for v in variants}
    ratios = {}
    for base in ("torch", "onnx20", "mlir-scan-dense"):
        if base in med:
            ratios[f"vs_{base}"] = {v: {"prefill": med[v][0] / med[base][0], "decode": med[v][1] / med[base][1]}
                                    for v in variants if v != base}
    report = {"benchmark": "onnx_export", "model": a.model, "T": a.T, "steps": a.steps, "repeats": a.repeats,
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": "python bench/onnx_export.py " + " ".join(sys.argv[1:]),
              "load_average_before": load_before, "load_average_after": load_average(),
              "params_total": int(sum(int(np.prod(np.shape(p))) for p in params.values())),
              "rows": rows, "ratios": ratios}
    for r in rows:
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        print(f"{r['variant']:20s} prefill {p['median']:8.1f} tok/s ({p['min']:.1f}-{p['max']:.1f})   "
              f"decode {d['median']:6.1f} tok/s ({d['min']:.1f}-{d['max']:.1f})   err {r['logits_rel_err_vs_torch']}")
    print(json.dumps(ratios, indent=1))
    out = a.out or result_path("onnx_export")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
