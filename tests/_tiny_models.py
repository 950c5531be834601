"""Tiny model configs shared by the export tests (ONNX, MLIR): k3-tiny and a Kimi Linear
config shrunk to 4 layers (3 KDA + 1 MLA, MoE with 8 experts)."""
from __future__ import annotations

import numpy as np

KIMI_LINEAR_TINY = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_token": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "linear_attn_config.num_heads": 2,
    "linear_attn_config.head_dim": 16, "vocab_size": 300, "num_hidden_layers": 4,
    "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3],
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mlp_layer_types": ["dense"] + ["sparse"] * 3,
}

MODELS = {"k3-tiny": ("k3-tiny", None), "kimi-linear-tiny": ("kimi-linear-6p6b", KIMI_LINEAR_TINY)}


def load_tiny(key: str):
    import k3ir
    name, overrides = MODELS[key]
    return k3ir.load(name, overrides)


def token_ids(vocab: int, batch: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + T).integers(0, min(vocab, 256), size=(batch, T)).astype(np.int64)


def prefill_decode(session, ids: np.ndarray, next_ids: np.ndarray):
    """(prefill logits, decode logits) as float64 arrays: prefill ``ids`` then one decode step."""
    logits, state = session.prefill(ids)
    step, _ = session.decode(next_ids, state)
    return logits.double().numpy(), step.double().numpy()


_ROUTES: dict = {}


def route_sessions(key: str, target: str, **compile_kw):
    """(module, params, float64 reference Session, target Executable, target Session) for one
    tiny model on the same random weights (seed 3); cached per (model, target) for a test run."""
    if (key, target) not in _ROUTES:
        from k3ir.runtime import Session
        from k3ir.runtime.params import init_params

        import k3ir
        m = load_tiny(key)
        params = init_params(m, seed=3)
        ref = Session(k3ir.compile(m, target="reference", dtype="float64"), params=params)
        exe = k3ir.compile(m, target=target, **compile_kw)
        _ROUTES[key, target] = (m, params, ref, exe, Session(exe, params=params))
    return _ROUTES[key, target]
