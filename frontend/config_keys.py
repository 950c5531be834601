"""Which config.json keys k3ir reads, which it ignores, and which it refuses (the HF-key policy).

- ``TEXT_KEYS`` / ``LAC_KEYS`` / ``VISION_KEYS`` / ``WRAPPER_KEYS``: the keys read at each level (an
  override may set one of these, or a key the file has); ``HF_EXTRAS``: keys transformers writes that
  k3ir ignores without a warning; any other key of a file is logged (warning, logger ``k3ir.config``).
- Duplicated keys: transformers' flat Kimi Linear keys mirror ``linear_attn_config`` (``LAC_MIRRORS``),
  ``qk_head_dim`` = nope + rope; ignored keys (``moe_layer_freq``, ``topk_method``) must not describe
  another architecture. A disagreement is a K3ConfigError naming the key.
- Kimi-family formats k3ir recognises but does not build (``UNSERVED_FAMILY``: Kimi K2, K2.5,
  DeepSeek-V3) are refused naming what sets them apart and the formats k3ir reads.
"""
from __future__ import annotations

import logging
from typing import Any

from k3ir.errors import K3ConfigError

from .config_reader import _Reader

log = logging.getLogger("k3ir.config")


#: keys the reader may read, per level (an override may set one of these or a key the file has)
TEXT_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "tie_word_embeddings", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "activation_situ_beta",
    "activation_situ_linear_beta", "intermediate_size", "first_k_dense_replace", "mlp_layer_types",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "linear_attn_config", "layer_types",
    "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_token",
    "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
    "moe_router_activation_func", "num_expert_group", "routed_scaling_factor", "moe_renormalize",
    "attn_res_block_size", "quantization_config"})
LAC_KEYS = frozenset({"full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                      "gate_lower_bound", "use_full_rank_gate"})
#: ``vision_config`` keys ``frontend/vision.py: vision_spec`` reads
VISION_KEYS = frozenset({"vt_hidden_size", "vt_num_attention_heads", "vt_num_hidden_layers", "vt_intermediate_size",
                         "merge_kernel_size", "mm_hidden_size", "text_hidden_size", "mm_projector_type",
                         "projector_hidden_act", "pos_emb_type", "merge_type", "patch_size", "init_pos_emb_height",
                         "init_pos_emb_width", "init_pos_emb_time", "projector_ln_eps"})
#: Kimi-family checkpoint formats that k3ir recognises but does not build yet (docs/checkpoints.md):
#: model_type -> what sets it apart from the formats k3ir reads.
UNSERVED_FAMILY = {
    "kimi_k2": "Kimi K2: DeepSeek-V3 layout with RoPE MLA, FP8 block-scaled experts",
    "deepseek_v3": "Kimi K2 / DeepSeek-V3 layout: RoPE MLA, FP8 block-scaled or INT4 experts",
    "kimi_k25": "Kimi K2.5: DeepSeek-V3 text model with RoPE MLA, INT4 experts, and a vision tower",
}
SUPPORTED_FORMATS = "model_type 'kimi_k3' (with text_config) and 'kimi_linear'"
WRAPPER_KEYS = frozenset({"model_type", "text_config", "vision_config", "media_placeholder_token_id"})
#: keys HF configs carry that k3ir deliberately ignores (no warning for these)
HF_EXTRAS = frozenset({
    "architectures", "model_type", "auto_map", "transformers_version", "_name_or_path", "use_cache",
    "initializer_range", "max_position_embeddings", "model_max_length", "attention_bias", "attention_dropout",
    "head_dim", "qk_head_dim", "id2label", "label2id", "pretraining_tp", "output_router_logits",
    "output_attentions", "output_hidden_states", "return_dict", "problem_type", "is_encoder_decoder",
    "chunk_size_feed_forward", "moe_layer_freq", "topk_method", "use_grouped_topk", "topk_group",
    "num_nextn_predict_layers", "rope_theta", "rope_scaling", "rope_parameters", "tokenizer_class",
    "ignore_keys_at_rope_validation"})


#: transformers' flat Kimi Linear keys -> the ``linear_attn_config`` key k3ir reads (and its default)
LAC_MIRRORS = {"linear_num_heads": ("num_heads", None), "linear_head_dim": ("head_dim", None),
               "linear_conv_kernel_dim": ("short_conv_kernel_size", 4)}


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")


def check_family_format(raw: dict, path: str | None) -> None:
    """Refuse a Kimi-family format k3ir does not build: K3ConfigError naming ``model_type`` (or
    ``text_config.model_type``), what sets that format apart, and the formats k3ir reads."""
    mt = raw.get("model_type")
    inner = raw["text_config"].get("model_type") if isinstance(raw.get("text_config"), dict) else None
    for key, value in (("model_type", mt), ("text_config.model_type", inner)):
        if isinstance(value, str) and value in UNSERVED_FAMILY:
            raise K3ConfigError(f"model_type {value!r} ({UNSERVED_FAMILY[value]}) is not supported yet; k3ir reads "
                                f"{SUPPORTED_FORMATS} (docs/checkpoints.md lists the formats)", key=key, path=path)


def _check_ignored_keys(text: dict, lac: dict, r: _Reader) -> None:
    """Keys k3ir does not read (HF_EXTRAS, duplicates of keys it reads) must not say another architecture than
    the one k3ir builds: K3ConfigError naming the key otherwise."""
    if isinstance(text.get("linear_attn_config"), dict):
        for flat, (inner, default) in LAC_MIRRORS.items():
            v, want = text.get(flat), lac.get(inner, default)
            if v is not None and want is not None and v != want:
                r.fail(flat, f"{v!r} disagrees with linear_attn_config.{inner} = {want!r} (k3ir reads "
                             f"linear_attn_config; set both or drop {flat})")
    qk = text.get("qk_head_dim")
    nope, rope = text.get("qk_nope_head_dim"), text.get("qk_rope_head_dim", 0)
    if qk is not None and isinstance(nope, int) and isinstance(rope, int) and qk != nope + rope:
        r.fail("qk_head_dim", f"{qk!r} disagrees with qk_nope_head_dim + qk_rope_head_dim = {nope} + {rope} = "
                              f"{nope + rope}")
    freq = text.get("moe_layer_freq")
    if freq is not None and freq != 1:
        r.fail("moe_layer_freq", f"only 1 is supported (every layer from first_k_dense_replace on is MoE), "
                                 f"got {freq!r}")
    tm = text.get("topk_method")
    if tm is not None and tm != "noaux_tc":
        r.fail("topk_method", f"only 'noaux_tc' is supported (sigmoid scores, top-k of scores + "
                              f"e_score_correction_bias), got {tm!r}")


def _known(raw: dict, parts: list[str]) -> bool:
    """Whether an override may set ``parts``: the file has it, or k3ir reads it."""
    node: Any = raw
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            break
        node = node[p]
    else:
        return True
    wrapped = "text_config" in raw
    rel = parts[1:] if wrapped and parts[0] == "text_config" else parts
    if wrapped and parts[0] == "vision_config":
        return len(parts) == 2 and parts[1] in VISION_KEYS
    if wrapped and len(parts) == 1:
        return parts[0] in WRAPPER_KEYS
    if not rel:
        return False
    if rel[0] == "linear_attn_config":
        return len(rel) == 2 and rel[1] in LAC_KEYS
    if rel[0] == "quantization_config":          # compressed-tensors' own schema
        return True
    return len(rel) == 1 and rel[0] in TEXT_KEYS


def _ignored_key(raw: dict, parts: list[str]) -> bool:
    """Whether ``parts`` is a key of the wrapper, the text config or ``vision_config`` that k3ir does not read
    (HF_EXTRAS are skipped at these levels); keys inside ``linear_attn_config`` etc. are never 'ignored'."""
    wrapped = "text_config" in raw
    if wrapped and len(parts) == 1:
        return parts[0] not in WRAPPER_KEYS
    if wrapped and parts[0] == "vision_config":
        return len(parts) == 2 and parts[1] not in VISION_KEYS
    rel = parts[1:] if wrapped and parts[0] == "text_config" else parts
    return len(rel) == 1 and rel[0] not in TEXT_KEYS


def _warn_unknown(raw: dict, path: str | None) -> None:
    """Log (warning) keys of a config FILE that k3ir neither reads nor knows to ignore."""
    wrapped = "text_config" in raw
    text = raw.get("text_config") if wrapped else raw
    extra = [k for k in raw if k not in WRAPPER_KEYS | HF_EXTRAS] if wrapped else []
    if isinstance(text, dict):
        pre = "text_config." if wrapped else ""
        extra += [pre + k for k in text if k not in TEXT_KEYS | HF_EXTRAS]
        lac = text.get("linear_attn_config")
        if isinstance(lac, dict):
            extra += [f"{pre}linear_attn_config.{k}" for k in lac if k not in LAC_KEYS]
    vc = raw.get("vision_config") if wrapped else None
    if isinstance(vc, dict):
        extra += [f"vision_config.{k}" for k in vc if k not in VISION_KEYS | HF_EXTRAS]
    if extra:
        log.warning("%s: ignoring %d unknown config key(s): %s", path or "config", len(extra), ", ".join(extra))
