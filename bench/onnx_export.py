"""CPU tokens/s of the export routes of one model side by side in ONE process, same random weights, same tokens:
torch eager (its default pipeline: the baseline), the ONNX exports run by onnxruntime (opset 20 with KDA as a
``Scan``; opset 27 with the standard ``LinearAttention``/``CausalConvWithState``; opset 27 with ``--ort-kernels``;
the routed experts as expert-sorted slices, the default, or as the ``Loop`` over experts) and, with ``--mlir``,
IREE llvm-cpu (the ``mlir`` target: ``mlir``, chunked KDA, sorted MoE, the weight contractions as named
``linalg.matmul``, the weights as IREE parameter globals and prefill compiled with IREE's data tiling and
microkernels, the default; ``mlir-scan-dense``, the earlier lowering entirely, kept behind ``MlirConfig(kda_form="scan",
moe_form="dense", linear_form="generic", conv_form="decomposed", param_form="arguments", data_tiling=False)``
(``KEPT_MLIR``): token-by-token KDA, every token through every expert, every contraction a ``linalg.generic``, the
short conv decomposed, the weights as trailing arguments, no data tiling). The onnx variants run the
exported file's default ``logits_to_keep`` = 1 (the head on the last prompt position only, what generation needs;
torch and IREE compute all T positions); ``onnx27-ort-all`` and ``onnx20-all`` feed 0 (all T), for the like-for-like
comparison. On request (``--variants``):
``mlir-generic`` (``MlirConfig(linear_form="generic")``: the default lowering with the weight contractions as
``linalg.generic``, what the named ``linalg.matmul`` adds), ``mlir-args`` (the default lowering with
``param_form="arguments", data_tiling=False``: what the parameter globals and data tiling add; the kept
lowering's forms do not compile with data tiling in IREE 3.13), ``mlir-bf16`` (``MlirConfig(weights="bf16")``: bf16 weight arguments, so its logits differ from torch's by the bf16
rounding of the random weights), ``mlir-last`` and ``mlir-scan-dense-last`` (``MlirConfig(logits_to_keep=1)``: the head
on the last prompt position only, as the onnx variants by default) and ``mlir-mxfp4`` (routed experts packed as MXFP4, ``--quantize mxfp4``: its
logits differ by the quantisation); ``onnx27-ort-split`` and ``onnx20-split``: the onnx target with the ``fuse-linear-splits``
pass before its ``dce`` (the projections that read one input as one ``MatMul`` and a ``Split``).

    python bench/onnx_export.py                       # k3-100m, T=128, 16 decode steps
    python bench/onnx_export.py --variants torch,onnx27-ort,onnx20 --T 64

Prefill: T tokens, batch 1; decode: ``--steps`` greedy steps after a T-token prefill, tokens/s = steps / wall time.
The copy bandwidth and float32 GEMM rate (torch, a 512-cube; ``benchlib.measure_ceilings``) are measured at the
start of the same run. ``--profile``: after the timed rounds, ``--repeats`` profiled prefills per onnx variant
(``SessionOptions.enable_profiling``, on the feeds of the timed prefill) give the node time per ONNX op type (the
median over them) and the positions their logits hold (``profile_logit_positions``, beside the timed run's
``logit_positions``), and the JSON gets the prefill's FLOPs per IR op type (``opdef.flops``). Every session is built and warmed up first (IREE compiles then, not in the timings); then 3 repeats interleaved
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
from benchlib import git_commit, measure_ceilings, result_path
from cpu_backends import K3_100M
from k3ir.runtime import Session
from k3ir.runtime.params import init_param

import k3ir

MODELS = {"k3-tiny": ("k3-tiny", None), "k3-100m": ("k3-tiny", K3_100M)}
#: the kept lowering (today's before issue 20): token-scan KDA, dense MoE, generic contractions, the short conv's
#: decomposition, weights as trailing arguments, compiled without data tiling (the same MLIR text and flags as before)
KEPT_MLIR = {"kda_form": "scan", "moe_form": "dense", "linear_form": "generic", "conv_form": "decomposed",
             "param_form": "arguments", "data_tiling": False}
#: variant -> (target, settings: onnx (opset, ort_kernels, moe_form, logits_to_keep[, pass list in place of the
#: target's pipeline]) or MlirConfig changes)
VARIANTS = {
    "torch": ("torch", None),
    "onnx27-ort": ("onnx", (27, True, "sorted", 1)),
    "onnx27-ort-all": ("onnx", (27, True, "sorted", 0)),
    "onnx27-ort-moeloop": ("onnx", (27, True, "loop", 1)),
    "onnx27-std": ("onnx", (27, False, "sorted", 1)),
    "onnx20": ("onnx", (20, False, "sorted", 1)),
    "onnx20-all": ("onnx", (20, False, "sorted", 0)),
    "onnx20-moeloop": ("onnx", (20, False, "loop", 1)),
    # with fuse-linear-splits (the projections that read one input as one MatMul + Split; not the target's default)
    "onnx27-ort-split": ("onnx", (27, True, "sorted", 1, ["fuse-linear-splits", "dce"])),
    "onnx20-split": ("onnx", (20, False, "sorted", 1, ["fuse-linear-splits", "dce"])),
    "mlir": ("mlir", {}),
    "mlir-scan-dense": ("mlir", dict(KEPT_MLIR)),
    "mlir-last": ("mlir", {"logits_to_keep": 1}),
    "mlir-scan-dense-last": ("mlir", {**KEPT_MLIR, "logits_to_keep": 1}),
    # the default lowering with the weights as arguments and no data tiling (the default before both)
    "mlir-args": ("mlir", {"param_form": "arguments", "data_tiling": False}),
    "mlir-generic": ("mlir", {"linear_form": "generic"}),
    "mlir-bf16": ("mlir", {"weights": "bf16"}),
    "mlir-mxfp4": ("mlir", {"passes": ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]}),
}
MLIR_VARIANTS = ("mlir", "mlir-scan-dense")
DEFAULT = "torch,onnx27-ort,onnx27-ort-all,onnx27-ort-moeloop,onnx27-std,onnx20,onnx20-all,onnx20-moeloop"


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
            exe.build_all(("prefill", "decode"))
        return s, time.perf_counter() - t
    exe = k3ir.compile(m, target=target, dtype="float32", passes=settings[4] if settings and len(settings) > 4 else None)
    if target == "onnx":
        exe.opset, exe.ort_kernels, exe.moe_form, exe.logits_to_keep = settings[:4]
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


def profile_prefill(s: Session, ids, runs: int) -> tuple[dict, int]:
    """Node milliseconds per ONNX op type of ``runs`` profiled prefills of an onnx ``Session`` (a fresh onnxruntime
    session of the same model and options, ``enable_profiling``; one warm-up run first) on the feeds of the timed
    prefill (the executable's own, ``OnnxExecutable.feeds``: the tokens, the empty state and its ``logits_to_keep``).
    Returns ``{op_type: [ms, nodes]}`` (ms: the median over the runs of the op type's summed node time, so one run
    slowed by load from other processes does not make the row), largest first, and the positions the profiled runs'
    logits hold."""
    import onnxruntime as ort
    exe = s.exe
    state = s.empty_state(ids.shape[0])
    feeds = exe.feeds("prefill", [np.asarray(ids, np.int64)] + [state.values[n] for n in state.names])
    so = ort.SessionOptions()
    for key, value in exe.session_config.items():
        so.add_session_config_entry(key, value)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(os.path.dirname(result_path("onnx_export")), ".profile")
    sess = ort.InferenceSession(exe.model("prefill").SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    marks = []                                         # microseconds since the epoch at the start of each run
    for _ in range(runs):
        marks.append(time.time_ns() // 1000)
        logits = sess.run(None, feeds)[0]
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    start = sess.get_profiling_start_time_ns() // 1000
    per_run: list[dict[str, list]] = [{} for _ in range(runs)]
    for e in events:                                   # node events of the profiled runs, by run
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and start + e["ts"] >= marks[0]:
            i = sum(1 for m in marks if start + e["ts"] >= m) - 1
            row = per_run[i].setdefault(e["args"]["op_name"], [0.0, 0])
            row[0] += e["dur"] / 1e3
            row[1] += 1
    out = {op: [statistics.median(r.get(op, [0.0])[0] for r in per_run), n] for op, (_, n) in per_run[0].items()}
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0])), int(logits.shape[1])


def prefill_flops(m, T: int) -> dict:
    """FLOPs of one batch-1 prefill of ``T`` tokens per IR op type (``opdef.flops``, multiply-add = 2), largest first."""
    from k3ir.opdef import get_opdef
    env = {"B": 1, "T": T, "L": 0}
    out: dict[str, float] = {}
    for op in m.functions["prefill"].ops:
        if op.name != "k3.param":
            types = [v.type for v in op.operands]
            f = get_opdef(op.name)(op.attrs, types).flops(types, [r.type for r in op.results], env) or 0.0
            if f:
                out[op.name] = out.get(op.name, 0.0) + f
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


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
    ap.add_argument("--profile", action="store_true",
                    help="node time per ONNX op type of each onnx variant (median of --repeats profiled prefills)")
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
    ceilings = measure_ceilings(copy_gib=0.25, mm_n=512, device="cpu")
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
    profiles = {v: profile_prefill(sessions[v], ids, a.repeats) for v in variants
                if a.profile and VARIANTS[v][0] == "onnx"}
    ref = logits.get("torch")
    rows = []
    for v in variants:
        want = None if ref is None else ref[:, ref.shape[1] - logits[v].shape[1]:]     # the positions it kept
        err = None if ref is None else float(np.linalg.norm(logits[v] - want) / np.linalg.norm(want))
        prof, kept = profiles.get(v, (None, None))
        rows.append({"variant": v, "target": VARIANTS[v][0], "onnx": VARIANTS[v][1], "build_s": build[v],
                     "prefill_tok_s": stats(pre[v]), "decode_tok_s": stats(dec[v]), "logits_rel_err_vs_torch": err,
                     "logit_positions": int(logits[v].shape[1]), "profile_ms_by_op_type": prof,
                     "profile_logit_positions": kept})
    med = {v: (statistics.median(pre[v]), statistics.median(dec[v])) for v in variants}
    ratios = {}
    for base in ("torch", "onnx20", "onnx20-all", "onnx20-split", "onnx27-ort-split", "mlir-scan-dense",
                 "mlir-scan-dense-last"):
        if base in med:
            ratios[f"vs_{base}"] = {v: {"prefill": med[v][0] / med[base][0], "decode": med[v][1] / med[base][1]}
                                    for v in variants if v != base}
    report = {"benchmark": "onnx_export", "model": a.model, "T": a.T, "steps": a.steps, "repeats": a.repeats,
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": "python bench/onnx_export.py " + " ".join(sys.argv[1:]),
              "load_average_before": load_before, "load_average_after": load_average(),
              "params_total": int(sum(int(np.prod(np.shape(p))) for p in params.values())),
              "ceilings": ceilings, "prefill_flops_by_op": prefill_flops(m, a.T),
              "rows": rows, "ratios": ratios}
    for r in rows:
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        print(f"{r['variant']:20s} prefill {p['median']:8.1f} tok/s ({p['min']:.1f}-{p['max']:.1f})   "
              f"decode {d['median']:6.1f} tok/s ({d['min']:.1f}-{d['max']:.1f})   err {r['logits_rel_err_vs_torch']}")
    print(json.dumps(ratios, indent=1))
    for v, (prof, kept) in profiles.items():
        total = sum(ms for ms, _ in prof.values())
        print(f"{v}: logits of {kept} positions, node time {total:.1f} ms: "
              + ", ".join(f"{k} {ms:.1f} ({n})" for k, (ms, n) in list(prof.items())[:8]))
    out = a.out or result_path("onnx_export")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
