"""Regenerate the golden pass files: ``python tests/passes/golden/make_golden.py [CASE ...]`` writes, for each
pass (or only the named cases), ``<pass>/input.k3`` (a small module) and ``<pass>/expected.k3`` (the pass's output).
Review the diff by eye before committing: the goldens pin the printed form of each rewrite;
the numerics tests (tests/passes/test_passes*.py) check the values."""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

#: a 3-layer Kimi Linear (KDA dense, KDA MoE, MLA MoE): low-rank output gate, softplus gate
KIMI_LINEAR_SMALL = {
    "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_token": 2, "num_attention_heads": 1, "num_key_value_heads": 1, "kv_lora_rank": 32,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "linear_attn_config.num_heads": 1,
    "linear_attn_config.head_dim": 8, "vocab_size": 16, "num_hidden_layers": 3,
    "linear_attn_config.full_attn_layers": [3], "linear_attn_config.kda_layers": [1, 2],
    "layer_types": ["linear_attention"] * 2 + ["full_attention"], "mlp_layer_types": ["dense", "sparse", "sparse"],
}
#: the same with the K3 keys: lower-bounded gate, full-rank output gate, AttnRes, latent MoE, SiTU
K3_SMALL = dict(KIMI_LINEAR_SMALL, **{
    "linear_attn_config.gate_lower_bound": -5.0, "linear_attn_config.use_full_rank_gate": True,
    "attn_res_block_size": 2, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "hidden_act": "situ",
    "mla_use_output_gate": True, "q_lora_rank": 16,
})

#: the triton pipeline's passes before its decode phase
_BEFORE_DECODE = "fuse-kda-chunks,fuse-moe-dispatch,fuse-attn-res,absorb-mla"

#: pass -> (config overrides, functions, pass specs run before it (comma-separated), pass spec)
CASES = {
    "fuse-kda-chunks": (KIMI_LINEAR_SMALL, ("decode",), None, "fuse-kda-chunks"),
    "fuse-kda-chunks-k3": (K3_SMALL, ("prefill",), None, "fuse-kda-chunks"),
    "fuse-moe-dispatch": (K3_SMALL, ("forward",), None, "fuse-moe-dispatch{capacity_factor=1.25}"),
    "quantize-experts": (K3_SMALL, ("forward",), "fuse-moe-dispatch", "quantize-experts{format=mxfp4}"),
    "absorb-mla": (KIMI_LINEAR_SMALL, ("decode",), None, "absorb-mla"),
    "fuse-decode-linear": (K3_SMALL, ("decode",), _BEFORE_DECODE, "fuse-decode-linear"),
    "fuse-decode-linear-kimi-linear": (KIMI_LINEAR_SMALL, ("decode",), _BEFORE_DECODE, "fuse-decode-linear"),
    "fuse-kda-output": (KIMI_LINEAR_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear", "fuse-kda-output"),
    "fuse-mla-kv-norm": (K3_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear", "fuse-mla-kv-norm"),
    "fuse-moe-experts": (K3_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear", "fuse-moe-experts"),
    "fuse-moe-experts-kimi-linear": (KIMI_LINEAR_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear",
                                     "fuse-moe-experts"),
    "fuse-moe-experts-ep": (K3_SMALL, ("decode",), "shard{ep=2}," + _BEFORE_DECODE + ",fuse-decode-linear",
                            "fuse-moe-experts"),
    "fuse-moe-front": (KIMI_LINEAR_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear,fuse-moe-experts",
                       "fuse-moe-front"),
    "fuse-decode-norm": (K3_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear,fuse-kda-output,"
                         "fuse-mla-kv-norm,fuse-moe-experts,fuse-moe-front", "fuse-decode-norm"),
    "fuse-decode-norm-kimi-linear": (KIMI_LINEAR_SMALL, ("decode",), _BEFORE_DECODE + ",fuse-decode-linear,"
                                     "fuse-kda-output,fuse-mla-kv-norm,fuse-moe-experts,fuse-moe-front",
                                     "fuse-decode-norm"),
    "fuse-linear-splits": (K3_SMALL, ("prefill",), None, "fuse-linear-splits"),
    "fuse-attn-res": (K3_SMALL, ("forward",), None, "fuse-attn-res"),
    "shard": (dict(K3_SMALL, **{"num_attention_heads": 2, "num_key_value_heads": 2, "linear_attn_config.num_heads": 2}),
              ("prefill",), None, "shard{ep=2,tp=2}"),
    "cse": (None, None, None, "cse"),
    "dce": (None, None, None, "dce"),
}


def small_module(overrides: dict, functions):
    from k3ir.frontend.config import load_config
    from k3ir.frontend.model import build_module
    m = build_module(load_config("kimi-linear-6p6b", overrides), functions=functions)
    m.name = "small"
    return m


def main(names=()) -> int:
    """Write the cases ``names`` (all when empty)."""
    from k3ir.passes import run_pipeline
    from k3ir.passes.manager import split_specs

    import k3ir
    for case, (overrides, functions, before, spec) in CASES.items():
        if names and case not in names:
            continue
        d = os.path.join(HERE, case)
        if overrides is None:                      # hand-written input (cse, dce)
            m = k3ir.parse_file(os.path.join(d, "input.k3"))
        else:
            m = small_module(overrides, functions)
            if before:
                run_pipeline(m, split_specs(before))
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "input.k3"), "w") as f:
                f.write(k3ir.print_module(m))
        run_pipeline(m, [spec], verify_each=True)
        with open(os.path.join(d, "expected.k3"), "w") as f:
            f.write(k3ir.print_module(m))
        with open(os.path.join(d, "pass.txt"), "w") as f:
            f.write(spec + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main(sys.argv[1:]))
