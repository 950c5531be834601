"""Whole-model correctness on the GPU (issue 6): triton vs torch on the same weights, same dtype
(float32 and bfloat16), prefill then CUDA-graph decode steps. Prints one table; exit 1 on a miss.

    python3 bench/gpu_model_check.py                        # decode as a CUDA graph (default)
    K3IR_CUDA_GRAPHS=0 python3 bench/gpu_model_check.py     # decode eagerly: graph capture vs kernels
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from k3ir.runtime import Session

import k3ir

KL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
      "intermediate_size": 512, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
      "mlp_layer_types": ["dense"] + ["sparse"] * 3,
      "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 2,
                             "short_conv_kernel_size": 4}}
MODELS = {"k3-tiny": ("k3-tiny", None), "kimi-linear-small": ("kimi-linear-6p6b", KL)}


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def main() -> int:
    rows, bad = [], 0
    for key, (name, ov) in MODELS.items():
        m = k3ir.load(name, ov)
        ids = np.random.default_rng(0).integers(0, 250, (2, 37))
        for dt, tol in (("float32", 2e-3), ("bfloat16", 5e-2)):   # TF32 dots; bf16 routing flips
            try:      # one failing case (e.g. a kernel over the shared-memory limit) must not hide the others
                ref = Session(k3ir.compile(m, target="torch", dtype=dt, device="cuda"))
                tri = Session(k3ir.compile(m, target="triton", dtype=dt, device="cuda"))
                want, s_ref = ref.prefill(ids)
                got, s_tri = tri.prefill(ids)
                errs = [rel(got, want)]
                for step in range(3):
                    nxt = np.array([[5 + step], [17 + step]])
                    want, s_ref = ref.decode(nxt, s_ref)
                    got, s_tri = tri.decode(nxt, s_tri)
                    errs.append(rel(got, want))
            except Exception as e:      # noqa: BLE001
                bad += 1
                rows.append((key, dt, float("nan"), float("nan"), tol, f"ERROR {type(e).__name__}: {str(e)[:160]}"))
                print(f"{key} {dt}: {type(e).__name__}: {e}", flush=True)
                continue
            ok = max(errs) < tol
            bad += not ok
            rows.append((key, dt, errs[0], max(errs[1:]), tol, "ok" if ok else "MISS"))
    print(f"{'model':<18} {'dtype':<9} {'prefill rel':>12} {'decode rel':>12} {'tol':>7}  result")
    for r in rows:
        print(f"{r[0]:<18} {r[1]:<9} {r[2]:>12.2e} {r[3]:>12.2e} {r[4]:>7.0e}  {r[5]}")
    import os
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUDA-graph decode: {os.environ.get('K3IR_CUDA_GRAPHS', '1') != '0'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
