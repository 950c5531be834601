"""Logit controls for Kimi Linear against transformers' ``KimiLinearForCausalLM`` (issue 6): the same
weights in transformers, our torch target and our triton target, one B2 T64 forward each, all pairs
(rel err per SPEC.md 11 and top-1 agreement). Tells a peer convention difference (torch far from
transformers in float32) from a triton-only difference (triton far from torch) and from bf16 rounding
amplified by routing (torch and triton equally far from transformers in bf16 only).

Sections: ``4l`` = 4 layers at full width (KDA x3 + MLA; dense + 3 MoE) in float32 and bf16; ``full`` =
the whole 6.6B model in bf16 (its triton-vs-transformers gap was 0.35 on 2026-11-30).

    python3 bench/probes/kimi_logit_controls.py [--sections 4l,full]  # GPU; rows to bench/results/kimi_logit_controls/

With fla importable, transformers runs fla's kernels, whose autotuning takes minutes on a cold Triton cache;
without it (fla not on PYTHONPATH) transformers runs its PyTorch reference KDA: the same math, seconds.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: bench_models
import bench_models as bm


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="4l,full")
    a = ap.parse_args()
    from k3ir.frontend.hf_state_dict import params_from_transformers

    import k3ir
    gpu = torch.cuda.is_available()
    bm.DEV, bm.DT, bm.DTN = ("cuda", torch.bfloat16, "bfloat16") if gpu else ("cpu", torch.float32, "float32")
    secs = a.sections.split(",")
    if "4l" in secs:
        ov = bm.KL4 if gpu else bm.KL_SMALL
        m4 = k3ir.load("kimi-linear-6p6b", ov)
        for dt, dtn in dict.fromkeys(((torch.float32, "float32"), (bm.DT, bm.DTN))):
            try:
                hf, cfg = bm._hf_model(ov, dt)
                bm._logit_controls(m4, hf, params_from_transformers(m4, hf), dtn, "4 layers full width",
                                   cfg.vocab_size)
                del hf
            except Exception as e:  # noqa: BLE001 - a diagnostic must not lose the row
                bm.row("kimi", f"logits controls 4 layers {dtn}", error=repr(e)[:300])
            gc.collect()
            torch.cuda.empty_cache() if gpu else None
    if "full" in secs and gpu:
        try:
            m = k3ir.load("kimi-linear-6p6b")
            hf, cfg = bm._hf_model(None, bm.DT)
            bm._logit_controls(m, hf, params_from_transformers(m, hf), bm.DTN, "full model", cfg.vocab_size)
        except Exception as e:  # noqa: BLE001 - a diagnostic must not lose the row
            bm.row("kimi", "logits controls full model", error=repr(e)[:300])


if __name__ == "__main__":
    main()
