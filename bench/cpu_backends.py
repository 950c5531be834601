"""CPU tokens/s of the export targets: torch eager vs onnxruntime (``onnx``) vs IREE llvm-cpu
(``mlir``), prefill and decode, batch 1, float32, same random weights (seed 0).

    python bench/cpu_backends.py            # JSON to bench/results/cpu_backends/<date>-<commit>.json

Targets: ``torch`` (its default pipeline: fused KDA, MoE dispatch, MXFP4 experts, ...),
``torch-unfused`` (torch on the graph the exporters see: ``dce`` only), ``onnx``, ``mlir``.
Models: k3-tiny and ``k3-100m`` (k3-tiny's layer schedule at hidden 512, 16 experts top-4,
vocab 32000: ~105 M parameters, ~50 M active). Prefill: T=64 tokens, median of 3 runs after a
warm-up; decode: 16 steps after a 64-token prefill, tokens/s = 16 / wall time. IREE compile time
is reported separately (modules are cached in ~/.cache/k3ir after the first build).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from k3ir.runtime import Session
from k3ir.runtime.params import init_param

import k3ir
from k3ir.accounting import report

K3_100M = {"hidden_size": 512, "vision_config.text_hidden_size": 512, "intermediate_size": 1536,
           "moe_intermediate_size": 512, "routed_expert_hidden_size": 256, "num_experts": 16,
           "num_experts_per_token": 4, "num_shared_experts": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
           "v_head_dim": 64, "linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 128,
           "vocab_size": 32000}
MODELS = {"k3-tiny": ("k3-tiny", None), "k3-100m": ("k3-tiny", K3_100M)}


def text_params(m):
    return {n: init_param(m.params[n]) for n in m.params}


def bench(sess: Session, T: int, steps: int, reps: int = 3) -> dict:
    ids = np.random.default_rng(0).integers(0, 256, size=(1, T))
    sess.prefill(ids)                                                     # warm-up (and lazy builds)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        logits, state = sess.prefill(ids)
        times.append(time.perf_counter() - t)
    prefill = T / statistics.median(times)
    tok = logits[:, -1:].argmax(-1).numpy()
    logits, state = sess.decode(tok, state)                              # warm-up decode
    t = time.perf_counter()
    for _ in range(steps):
        tok = logits[:, -1:].argmax(-1).numpy()
        logits, state = sess.decode(tok, state)
    decode = steps / (time.perf_counter() - t)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}



def make_session(m, target: str, params: dict) -> tuple[Session, float]:
    t = time.perf_counter()
    if target == "torch-unfused":                  # torch on the same unfused, unquantised graph as onnx/mlir
        exe = k3ir.compile(m, target="torch", dtype="float32", passes=["dce"])
    else:
        exe = k3ir.compile(m, target=target, dtype="float32")
    s = Session(exe, params=params)
    if target == "mlir":                                                  # compile now, not in the timing
        exe.compile_group(("prefill", "decode"))
    return s, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON rows (default bench/results/cpu_backends/<date>-<commit>.json)")
    ap.add_argument("--models", default="k3-tiny,k3-100m")
    ap.add_argument("--targets", default="torch,torch-unfused,onnx,mlir")
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    rows = []
    for key in a.models.split(","):
        name, over = MODELS[key]
        m = k3ir.load(name, over)
        r = report(m)
        params = text_params(m)
        n = r.params_total
        for target in a.targets.split(","):
            s, build = make_session(m, target, params)
            res = bench(s, a.T, a.steps)
            row = {"model": key, "params": n, "active": r.params_active, "target": target, "build_s": build, **res}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from benchlib import result_path
        a.out = result_path("cpu_backends")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
