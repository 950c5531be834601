"""HF-style config.json -> validated ModelConfig (SPEC.md section 1).

Accepts the ``kimi_k3`` wrapper (``text_config`` + ``vision_config``) and a plain
``kimi_linear`` config. Every error names the file and the key (``K3ConfigError``). Sizes, integer
ranges and JSON nesting are bounded before anything loops or allocates (``config_bounds.py``).
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3ConfigError

from . import config_bounds as bounds

BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "configs")
BUNDLED = {"kimi-k3": "kimi-k3.json", "k3-tiny": "k3-tiny.json", "kimi-linear-6p6b": "kimi-linear-6p6b.json"}

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
#: keys whose explicit null means "use the default" (transformers writes ``dtype: null``)
NULL_MEANS_DEFAULT = frozenset({"dtype", "torch_dtype"})

_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "bf16": "bf16", "f32": "f32", "f16": "f16"}


@dataclass
class ModelConfig:
    """The text model's architecture, normalised. Layer indices here are 0-based."""
    name: str
    model_type: str                      # "kimi_k3" | "kimi_linear"
    key_prefix: str                      # "language_model." for the kimi_k3 layout
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: str                           # IR dtype of weights/activations: bf16 | f16 | f32
    bos_token_id: int | None
    eos_token_id: int | list | None
    pad_token_id: int | None
    hidden_act: str                      # "situ" | "silu"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    first_k_dense_replace: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None       # None: softplus gate (Kimi Linear)
    full_rank_gate: bool
    mla_layers: list[int]
    kda_layers: list[int]
    # MoE
    num_experts: int
    top_k: int
    num_shared_experts: int
    moe_intermediate_size: int
    latent_size: int | None              # routed_expert_hidden_size
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    attn_res_block_size: int | None
    expert_quant: str | None = None      # "mxfp4" | "int4" | None (what the config says)
    quant_ignore: list[str] = field(default_factory=list)
    media_placeholder_token_id: int | None = None
    vision: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)
    path: str | None = None

    @property
    def kda_gate_form(self) -> str:
        return "softplus" if self.gate_lower_bound is None else "lower_bound"

    def layer_kind(self, i: int) -> str:
        return "mla" if i in self._mla_set else "kda"

    @property
    def _mla_set(self) -> set[int]:
        return set(self.mla_layers)

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


# ---- loading -------------------------------------------------------------------------
def resolve_config_path(name_or_path: str) -> str:
    """A bundled name, a config.json path, or a directory holding config.json."""
    if name_or_path in BUNDLED:
        return os.path.join(BUNDLED_DIR, BUNDLED[name_or_path])
    if os.path.isdir(name_or_path):
        p = os.path.join(name_or_path, "config.json")
        if not os.path.exists(p):
            if os.path.exists(os.path.join(name_or_path, "manifest.json")):
                raise K3ConfigError("is a compiled artifact (manifest.json), not a model: run it with "
                                    "k3ir.runtime.Session.load(DIR); commands take a model name, config.json "
                                    "or checkpoint directory", path=name_or_path)
            raise K3ConfigError("directory has no config.json", path=name_or_path)
        return p
    if os.path.isfile(name_or_path):
        return name_or_path
    bare = "/" not in str(name_or_path) and os.sep not in str(name_or_path)     # a name, not a path
    near = difflib.get_close_matches(str(name_or_path).lower(), list(BUNDLED), n=1) if bare else []
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise K3ConfigError(f"no such file, directory or bundled model (bundled: {', '.join(BUNDLED)}){hint}",
                        path=name_or_path)


def read_config(name_or_path: str) -> tuple[Any, str]:
    """The parsed JSON of a config and its path. K3ConfigError naming the file for a file that cannot be
    read, is larger than ``config_bounds.MAX_CONFIG_BYTES``, is not UTF-8 or not JSON (line and column),
    nests deeper than ``MAX_JSON_DEPTH`` (line and column) or holds an integer outside 64 bits (its key)."""
    path = resolve_config_path(name_or_path)
    try:
        with open(path, "rb") as f:
            data = f.read(bounds.MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise K3ConfigError(f"cannot read: {e.strerror or e}", path=path) from None
    if len(data) > bounds.MAX_CONFIG_BYTES:
        raise K3ConfigError(f"larger than {bounds.MAX_CONFIG_BYTES} bytes: not a model config", path=path)
    text = bounds.decode_utf8(data, path)
    try:
        raw = bounds.loads(text, path)
    except json.JSONDecodeError as e:
        from k3ir.runtime.train_checkpoint import pointer_message  # `k3ir generate run/checkpoints/latest`
        raise K3ConfigError(pointer_message(path) or f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                            path=path) from None
    bounds.check_huge(raw, path)
    return raw, path


def parse_override_value(text: str) -> Any:
    """``--set key=value``: JSON when it parses (numbers, true/false/null, lists), else a string (also JSON
    nested deeper than ``config_bounds.MAX_JSON_DEPTH``, which no key accepts). An integer outside 64 bits
    is a ``config_bounds.HugeInt`` (never converted), refused by ``load_config`` naming the key."""
    try:
        return bounds.loads(text, None)
    except (json.JSONDecodeError, K3ConfigError):
        return text


def apply_overrides(raw: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys. For a ``kimi_k3`` wrapper, keys not starting with ``text_config.``/
    ``vision_config.`` (or naming a top-level key) go to ``text_config``; dotted keys reach
    ``linear_attn_config``. Overriding ``num_hidden_layers`` alone re-derives the layer lists
    (MLA layers beyond the new depth dropped; KDA = the complement; ``layer_types`` /
    ``mlp_layer_types`` / ``first_k_dense_replace`` follow); overriding ``hidden_size``
    alone also sets ``vision_config.text_hidden_size`` (the projector's output width)."""
    if not overrides:
        return raw
    cfg = copy.deepcopy(raw)
    wrapped = "text_config" in cfg
    for key, value in overrides.items():
        parts = override_path(cfg, key)
        node = cfg
        for p in parts[:-1]:
            if p not in node or not isinstance(node[p], dict):
                if p in node:
                    raise K3ConfigError(f"cannot set '{key}': '{p}' is not an object", key=key)
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    text = cfg["text_config"] if wrapped else cfg
    if not isinstance(text, dict):
        return cfg                                 # the validator names text_config
    keys = {k.split(".")[-1] for k in overrides}
    _sync_duplicates(text, keys)
    if "vocab_size" in keys:
        _follow_vocab(raw, cfg, keys)
    vision = cfg.get("vision_config") if wrapped else None
    if ("hidden_size" in keys and isinstance(vision, dict) and "text_hidden_size" in vision
            and not any(k.endswith("text_hidden_size") for k in overrides)):
        vision["text_hidden_size"] = text.get("hidden_size")      # the projector follows the text width
    lac = text.get("linear_attn_config")
    if "num_hidden_layers" in keys and isinstance(lac, dict) and "full_attn_layers" not in keys:
        n = text["num_hidden_layers"]
        if _layer_count(n):
            lac["full_attn_layers"] = [i for i in lac.get("full_attn_layers", []) if isinstance(i, int) and i <= n]
            lac["kda_layers"] = [i for i in range(1, n + 1) if i not in lac["full_attn_layers"]]
    elif "full_attn_layers" in keys and isinstance(lac, dict) and "kda_layers" not in keys:
        n = text.get("num_hidden_layers")
        if _layer_count(n) and isinstance(lac.get("full_attn_layers"), list):
            lac["kda_layers"] = [i for i in range(1, n + 1) if i not in lac["full_attn_layers"]]
    if "num_hidden_layers" in keys and _layer_count(text.get("num_hidden_layers")):
        _rederive_per_layer_lists(text, keys)
    return cfg


def _layer_count(n: Any) -> bool:
    """Whether ``n`` is a layer count the layer lists may be derived from (loops over it): an int in
    ``1..UPPER_BOUNDS['num_hidden_layers']``; anything else is left for the validator to name."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= bounds.UPPER_BOUNDS["num_hidden_layers"]


#: transformers' flat Kimi Linear keys -> the ``linear_attn_config`` key k3ir reads (and its default)
LAC_MIRRORS = {"linear_num_heads": ("num_heads", None), "linear_head_dim": ("head_dim", None),
               "linear_conv_kernel_dim": ("short_conv_kernel_size", 4)}


def _follow_vocab(old_raw: dict, cfg: dict, keys: set[str]) -> None:
    """After ``vocab_size`` changed by an override: special token ids that are not overridden themselves and fall
    outside the new vocabulary keep their distance from its end (Kimi K3's bos 163584 of 163840 -> 256 of 512);
    one that would go below 0 becomes null. A scaled-down test model thus keeps valid special tokens."""
    old_text = old_raw.get("text_config", old_raw)
    text = cfg.get("text_config", cfg)
    if not isinstance(old_text, dict) or not isinstance(text, dict):
        return
    old_v, new_v = old_text.get("vocab_size"), text.get("vocab_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (old_v, new_v)):
        return

    def move(x):
        if not isinstance(x, int) or isinstance(x, bool) or 0 <= x < new_v:
            return x
        y = new_v - (old_v - x)
        return y if 0 <= y < new_v else None
    for d in ([text, cfg] if cfg is not text else [text]):
        for k in TOKEN_ID_KEYS:
            if k in keys or d.get(k) is None:
                continue
            v = d[k]
            d[k] = [move(x) for x in v] if isinstance(v, list) else move(v)
            if isinstance(d[k], list):
                d[k] = [x for x in d[k] if x is not None] or None


def _sync_duplicates(text: dict, keys: set[str]) -> None:
    """After overrides: a key that duplicates another in the file follows it when only one of the two was set
    (``linear_num_heads`` <-> ``linear_attn_config.num_heads`` ..., ``qk_head_dim`` = nope + rope), so that
    ``--set`` of either changes the model and the loader's agreement check passes."""
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict):
        whole = "linear_attn_config" in keys                   # the dict overridden as a whole
        for flat, (inner, default) in LAC_MIRRORS.items():
            if flat in keys and inner not in keys and not whole:
                lac[inner] = text.get(flat)
            elif (inner in keys or whole) and flat not in keys and flat in text:
                text[flat] = lac.get(inner, default)
    if "qk_head_dim" in text and "qk_head_dim" not in keys and keys & {"qk_nope_head_dim", "qk_rope_head_dim"}:
        nope, rope = text.get("qk_nope_head_dim"), text.get("qk_rope_head_dim", 0)
        if isinstance(nope, int) and isinstance(rope, int):
            text["qk_head_dim"] = nope + rope


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


def _rederive_per_layer_lists(text: dict, keys: set[str]) -> None:
    """After ``num_hidden_layers`` alone changed: the per-layer lists transformers' Kimi Linear
    config writes follow the new depth, as ``linear_attn_config`` does. ``layer_types`` comes
    from ``full_attn_layers`` (or is cut / padded with ``linear_attention``: KDA is the
    complement); ``mlp_layer_types`` keeps its leading dense layers up to the new depth and
    ``first_k_dense_replace`` is capped at it. Keys overridden too are left as given."""
    n = text["num_hidden_layers"]
    lac = text.get("linear_attn_config")
    lt = text.get("layer_types")
    if "layer_types" not in keys and isinstance(lt, list):
        full = lac.get("full_attn_layers") if isinstance(lac, dict) else None
        if isinstance(full, list):
            text["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
        else:
            text["layer_types"] = (lt + ["linear_attention"] * n)[:n]
    fk = text.get("first_k_dense_replace")
    if "first_k_dense_replace" not in keys and isinstance(fk, int) and not isinstance(fk, bool) and fk > n:
        text["first_k_dense_replace"] = n
    mt = text.get("mlp_layer_types")
    if "mlp_layer_types" not in keys and isinstance(mt, list):
        k = next((i for i, t in enumerate(mt) if t != "dense"), len(mt))
        k = min(k, n)
        text["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (n - k)


def override_path(raw: dict, key: str) -> list[str]:
    """The path an override ``key`` sets in ``raw`` (see ``apply_overrides``)."""
    parts = key.split(".")
    if "text_config" in raw and parts[0] not in ("text_config", "vision_config") and parts[0] not in raw:
        parts = ["text_config"] + parts
    return parts


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


def check_override_keys(raw: dict, overrides: dict[str, Any] | None, path: str | None = None) -> None:
    """K3ConfigError (``.override`` = the key) for an override naming a key that is neither in
    ``raw`` nor read by k3ir (a typo would otherwise be ignored silently)."""
    for key in overrides or {}:
        parts = override_path(raw, key)
        if all(parts) and parts[-1] in HF_EXTRAS - {"model_type"} and _ignored_key(raw, parts):
            msg = f"'{key}' is a key k3ir ignores (it would not change the model)"
            err = K3ConfigError(msg, path=_override_where(path, key))
            err.override, err.bare = key, msg
            raise err
        if not all(parts) or not _known(raw, parts):
            last = parts[-1]
            pool = VISION_KEYS if "vision_config" in parts[:1] else LAC_KEYS if "linear_attn_config" in parts \
                else TEXT_KEYS | WRAPPER_KEYS
            near = difflib.get_close_matches(last, sorted(pool), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            err = K3ConfigError(f"'{key}' is not a known key (not in the config and not read by k3ir){hint}",
                                path=_override_where(path, key))
            err.override, err.bare = key, f"'{key}' is not a known key (not in the config and not read by k3ir){hint}"
            raise err


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


def _override_where(path: str | None, key: str) -> str:
    return f"{path}, override '{key}'" if path else f"override '{key}'"


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


def _short(v: Any, n: int = 80) -> str:
    """``repr(v)`` cut to ``n`` characters (a hostile value may be megabytes long)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"of {v.bit_length()} bits"
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


class _Reader:
    """Typed access to a config dict; errors name the dotted key and the file."""

    def __init__(self, d: dict, prefix: str, path: str | None, reads: set[str] | None = None):
        self.d, self.prefix, self.path = d, prefix, path
        self.reads = reads if reads is not None else set()     # dotted keys read (tests check them)

    def peek(self, k: str) -> Any:
        """``d.get(k)``, recorded as read (keys whose null is legal: token ids, layer lists)."""
        self.reads.add(self.key(k))
        return self.d.get(k)

    def key(self, k: str) -> str:
        return f"{self.prefix}{k}"

    def fail(self, k: str, msg: str):
        raise K3ConfigError(msg, key=self.key(k), path=self.path)

    def get(self, k: str, typ, default: Any = ..., *, lo=None, hi=None, allow_none=False, choices=None):
        """The value of ``k`` checked against ``typ``/``lo``/``hi``/``choices``; ``default`` when
        absent (``...``: required). An explicit null is an error unless ``allow_none`` (or the key
        is in NULL_MEANS_DEFAULT): the default may mean something else than "none"."""
        self.reads.add(self.key(k))
        if k not in self.d or (self.d[k] is None and k in NULL_MEANS_DEFAULT and default is not ...):
            if default is ...:
                self.fail(k, "is required")
            return default
        v = self.d[k]
        if v is None:
            if allow_none:
                return None
            self.fail(k, "must not be null" + ("" if default is ... else " (omit it for the default)"))
        if isinstance(v, int) and not isinstance(v, bool) and not bounds.INT_MIN <= v <= bounds.INT_MAX:
            self.fail(k, f"integer {_short(v)} is out of the 64-bit range")
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            self.fail(k, f"must be {typ.__name__}, got {type(v).__name__} {_short(v)}")
        if typ is float and not math.isfinite(v):          # json.loads accepts NaN / Infinity
            self.fail(k, f"must be finite, got {v}")
        if choices is not None and v not in choices:
            self.fail(k, f"must be one of {list(choices)}, got {_short(v)}")
        if typ is int and (bound := bounds.upper_bound(self.key(k))) is not None:
            hi = bound if hi is None else min(hi, bound)
        if lo is not None and v < lo:
            self.fail(k, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            self.fail(k, f"must be <= {hi}, got {v}")
        return v

    def eps(self, k: str, default: float) -> float:
        """A normalisation epsilon: a finite float > 0 (``rsqrt(mean(x^2) + 0)`` of a zero row is inf)."""
        if (eps := self.get(k, float, default)) <= 0:
            self.fail(k, f"must be > 0, got {eps}")
        return eps


def build_config(raw: dict, path: str | None = None, name: str | None = None,
                 reads: set[str] | None = None) -> ModelConfig:
    """Validate ``raw`` (a config dict) into a ModelConfig; K3ConfigError names ``path`` and the
    key. ``reads``, when given, collects the dotted keys the reader looked at."""
    if not isinstance(raw, dict):
        raise K3ConfigError("config must be a JSON object", path=path)
    mt = raw.get("model_type")
    inner = raw["text_config"].get("model_type") if isinstance(raw.get("text_config"), dict) else None
    for key, value in (("model_type", mt), ("text_config.model_type", inner)):
        if isinstance(value, str) and value in UNSERVED_FAMILY:
            raise K3ConfigError(f"model_type {value!r} ({UNSERVED_FAMILY[value]}) is not supported yet; k3ir reads "
                                f"{SUPPORTED_FORMATS} (docs/checkpoints.md lists the formats)", key=key, path=path)
    if "text_config" in raw:
        if not isinstance(raw["text_config"], dict):
            raise K3ConfigError("must be an object", key="text_config", path=path)
        text, prefix, kp, model_type = raw["text_config"], "text_config.", "language_model.", "kimi_k3"
        if mt not in (None, "kimi_k3"):
            raise K3ConfigError(f"unsupported model_type {mt!r} with text_config (want 'kimi_k3')",
                                key="model_type", path=path)
    else:
        if mt not in ("kimi_linear", "kimi_k3", None):
            raise K3ConfigError(f"unsupported model_type {mt!r} (want 'kimi_k3' or 'kimi_linear')",
                                key="model_type", path=path)
        text, prefix, kp, model_type = raw, "", "", "kimi_linear"
    r = _Reader(text, prefix, path, reads)
    n_layers = r.get("num_hidden_layers", int, lo=1)
    hidden = r.get("hidden_size", int, lo=1)
    lac = _linear_attn_config(text, r, n_layers)
    _check_ignored_keys(text, lac, r)
    la = _Reader(lac, prefix + "linear_attn_config.", path, r.reads)
    full = la.get("full_attn_layers", list)
    for j, i in enumerate(full):
        if not isinstance(i, int) or isinstance(i, bool):
            la.fail("full_attn_layers", f"entry {j} must be an integer, got {i!r}")
        if not 1 <= i <= n_layers:
            la.fail("full_attn_layers", f"entry {j} = {i} is out of range 1..{n_layers} "
                    f"(layer lists are 1-based)")
    if len(set(full)) != len(full):
        la.fail("full_attn_layers", "has duplicates")
    mla_layers = sorted(i - 1 for i in full)
    complement = [i for i in range(n_layers) if i not in set(mla_layers)]
    if "kda_layers" in lac and lac["kda_layers"] is not None:
        kda = la.get("kda_layers", list)
        for j, i in enumerate(kda):
            if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= n_layers:
                la.fail("kda_layers", f"entry {j} = {i!r} is out of range 1..{n_layers} (layer lists are 1-based)")
        if sorted(i - 1 for i in kda) != complement:
            both = sorted(set(kda) & set(full))
            missing = sorted(set(range(1, n_layers + 1)) - set(kda) - set(full))
            detail = (f"layers in both lists: {both}" if both else f"layers in neither list: {missing}"
                      if missing else "it has duplicates")
            la.fail("kda_layers", f"must be the complement of full_attn_layers in 1..{n_layers}; {detail}")
    if len(mla_layers) + len(complement) != n_layers:
        r.fail("num_hidden_layers", "layer counts do not add up")
    act = r.get("hidden_act", str, "silu", choices=("situ", "silu"))
    heads = r.get("num_attention_heads", int, lo=1)
    kv_heads = r.get("num_key_value_heads", int, heads, lo=1)
    if kv_heads != heads:
        r.fail("num_key_value_heads", f"MLA needs num_key_value_heads == num_attention_heads ({heads})")
    if not r.get("mla_use_nope", bool, True):
        r.fail("mla_use_nope", "only NoPE MLA (no rotary embedding) is supported")
    for k in ("moe_router_activation_func",):
        r.get(k, str, "sigmoid", choices=("sigmoid",))
    if r.get("num_expert_group", int, 1, lo=1) != 1:
        r.fail("num_expert_group", "grouped top-k with more than one group is not supported")
    lb = la.get("gate_lower_bound", float, None, allow_none=True)
    if lb is not None and lb >= 0:
        la.fail("gate_lower_bound", f"must be negative, got {lb}")
    torch_dtype = r.get("torch_dtype", str, None, allow_none=True)
    torch_dtype = None if torch_dtype == "auto" else torch_dtype     # transformers' "auto": the file's dtype
    if torch_dtype is not None and torch_dtype not in _DTYPES:    # the older key: checked even when "dtype" wins
        r.fail("torch_dtype", f"unsupported dtype {torch_dtype!r} (want one of {sorted(_DTYPES)})")
    dtype_name = r.get("dtype", str, torch_dtype or "bfloat16")
    if dtype_name not in _DTYPES:
        r.fail("dtype", f"unsupported dtype {dtype_name!r} (want one of {sorted(_DTYPES)})")
    block = r.get("attn_res_block_size", int, None, lo=1, allow_none=True)
    latent = r.get("routed_expert_hidden_size", int, None, lo=1, allow_none=True)
    n_exp = r.get("num_experts", int, 1, lo=1)
    top_k = r.get("num_experts_per_token", int, 1, lo=1)
    if top_k > n_exp:
        r.fail("num_experts_per_token", f"top-k {top_k} exceeds num_experts {n_exp}")
    quant, ignore = _quant(text, r)
    vision = raw.get("vision_config") if model_type == "kimi_k3" else None
    if vision is not None and not isinstance(vision, dict):
        raise K3ConfigError("must be an object", key="vision_config", path=path)
    q_lora = r.get("q_lora_rank", int, None, lo=1, allow_none=True)
    eps = r.eps("rms_norm_eps", 1e-6)
    vocab = r.get("vocab_size", int, lo=1)
    _check_token_ids(raw, text, prefix, path, vocab)
    return ModelConfig(
        name=name or os.path.splitext(os.path.basename(path or "model"))[0],
        model_type=model_type, key_prefix=kp,
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layers,
        rms_norm_eps=eps,
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        dtype=_DTYPES[dtype_name],
        bos_token_id=r.peek("bos_token_id"), eos_token_id=r.peek("eos_token_id"),
        pad_token_id=r.peek("pad_token_id"),
        hidden_act=act,
        situ_beta=r.get("activation_situ_beta", float, 4.0, lo=1e-9),
        situ_linear_beta=r.get("activation_situ_linear_beta", float, 25.0, lo=1e-9),
        intermediate_size=r.get("intermediate_size", int, lo=1),
        first_k_dense_replace=_first_dense(text, r, n_layers),
        num_attention_heads=heads, q_lora_rank=q_lora,
        kv_lora_rank=r.get("kv_lora_rank", int, lo=1),
        qk_nope_head_dim=r.get("qk_nope_head_dim", int, lo=1),
        qk_rope_head_dim=r.get("qk_rope_head_dim", int, lo=0),
        v_head_dim=r.get("v_head_dim", int, lo=1),
        mla_use_output_gate=r.get("mla_use_output_gate", bool, False),
        kda_num_heads=la.get("num_heads", int, lo=1), kda_head_dim=la.get("head_dim", int, lo=1),
        conv_kernel=la.get("short_conv_kernel_size", int, 4, lo=1),
        gate_lower_bound=lb, full_rank_gate=la.get("use_full_rank_gate", bool, False),
        mla_layers=mla_layers, kda_layers=complement,
        num_experts=n_exp, top_k=top_k,
        num_shared_experts=r.get("num_shared_experts", int, 0, lo=0),
        moe_intermediate_size=r.get("moe_intermediate_size", int, lo=1),
        latent_size=latent, latent_moe_use_norm=r.get("latent_moe_use_norm", bool, False),
        routed_scaling_factor=r.get("routed_scaling_factor", float, 1.0, lo=0.0),
        moe_renormalize=r.get("moe_renormalize", bool, True),
        attn_res_block_size=block, expert_quant=quant, quant_ignore=ignore,
        media_placeholder_token_id=raw.get("media_placeholder_token_id"),
        vision=vision, raw=raw, path=path)


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")


def _check_token_ids(raw: dict, text: dict, prefix: str, path: str | None, vocab: int) -> None:
    """Special token ids (in ``text_config`` and at the top level; ``eos_token_id`` may be a list; null
    means none) are ints in ``0..vocab_size-1``. Raises K3ConfigError naming the dotted key."""
    places = [(text, prefix)] + ([(raw, "")] if raw is not text else [])
    for d, pre in places:
        for k in TOKEN_ID_KEYS:
            v = d.get(k)
            if v is None:
                continue
            vals = v if k == "eos_token_id" and isinstance(v, list) else [v]
            if not vals:
                raise K3ConfigError("must not be an empty list (null means no token)", key=pre + k, path=path)
            for x in vals:
                if not isinstance(x, int) or isinstance(x, bool):
                    raise K3ConfigError(f"must be an int token id, got {type(x).__name__} {x!r}",
                                        key=pre + k, path=path)
                if not 0 <= x < vocab:
                    raise K3ConfigError(f"must be in 0..{vocab - 1}, got {x}", key=pre + k, path=path)


def _linear_attn_config(text: dict, r: _Reader, n_layers: int) -> dict:
    """``linear_attn_config``, or one derived from the keys transformers' ``KimiLinearConfig``
    writes (``layer_types``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``);
    when both are present, ``layer_types`` must agree with ``full_attn_layers``."""
    lt = r.peek("layer_types")
    if lt is not None and (not isinstance(lt, list) or len(lt) != n_layers
                           or any(t not in ("full_attention", "linear_attention") for t in lt)):
        r.fail("layer_types", f"must list {n_layers} entries of 'full_attention' / 'linear_attention'")
    if "linear_attn_config" not in text and lt is not None:
        lac = {"full_attn_layers": [i + 1 for i, t in enumerate(lt) if t == "full_attention"],
               "num_heads": r.get("linear_num_heads", int, lo=1), "head_dim": r.get("linear_head_dim", int, lo=1),
               "short_conv_kernel_size": r.get("linear_conv_kernel_dim", int, 4, lo=1)}
        return lac
    lac = r.get("linear_attn_config", dict)
    full = lac.get("full_attn_layers")
    ints = isinstance(full, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in full)
    if lt is not None and ints and sorted(full) != [i + 1 for i, t in enumerate(lt) if t == "full_attention"]:
        r.fail("layer_types", f"disagrees with linear_attn_config.full_attn_layers {full} (1-based)")
    return lac


def _first_dense(text: dict, r: _Reader, n_layers: int) -> int:
    """``first_k_dense_replace``; transformers' ``mlp_layer_types`` must be that many ``dense``
    then ``sparse`` (and gives the count when the key is absent)."""
    mt = r.peek("mlp_layer_types")
    if mt is None:
        return r.get("first_k_dense_replace", int, 0, lo=0, hi=n_layers)
    if not isinstance(mt, list) or len(mt) != n_layers or any(t not in ("dense", "sparse") for t in mt):
        r.fail("mlp_layer_types", f"must list {n_layers} entries of 'dense' / 'sparse'")
    k = mt.index("sparse") if "sparse" in mt else n_layers
    if any(t != "sparse" for t in mt[k:]):
        r.fail("mlp_layer_types", "dense layers must come first (only first_k_dense_replace is supported)")
    fk = r.get("first_k_dense_replace", int, k, lo=0, hi=n_layers)
    if fk != k:
        r.fail("mlp_layer_types", f"has {k} leading dense layers but first_k_dense_replace is {fk}")
    return k


def _quant(text: dict, r: _Reader) -> tuple[str | None, list[str]]:
    qc = r.peek("quantization_config")
    if qc is None:
        return None, []
    if not isinstance(qc, dict):
        r.fail("quantization_config", "must be an object")
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if fmt is None and isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and g.get("format"):
                fmt = g["format"]
    known = {"mxfp4-pack-quantized": "mxfp4", "pack-quantized": "int4"}
    if not isinstance(fmt, str) or fmt not in known:
        r.fail("quantization_config.format", f"unsupported format {_short(fmt)} (want one of {sorted(known)})")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        r.fail("quantization_config.ignore", "must be a list of strings")
    return known[fmt], list(ignore)


def load_config(name_or_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """Read, override and validate a config (bundled name, config.json, or checkpoint dir).
    Keys of the FILE that k3ir does not know are logged (warning) and ignored; an override naming
    an unknown key, or one that makes the config invalid, raises K3ConfigError attributed to the
    override (message ``<file>, override 'key': ...``, ``.override`` = the key; the CLI shows
    ``--set key=value: ...``). Override values are checked against ``config_bounds`` (64-bit integers,
    UPPER_BOUNDS) before they are applied."""
    raw, path = read_config(name_or_path)
    if isinstance(raw, dict):
        _warn_unknown(raw, path)
        check_override_keys(raw, overrides, path)
    for key, value in (overrides or {}).items():    # before apply_overrides loops or copies by them
        bounds.check_override_value(key, value, _override_where(path, key))
    name = name_or_path if name_or_path in BUNDLED else None
    if name is None and os.path.isdir(name_or_path):
        name = os.path.basename(os.path.normpath(name_or_path))
    base = raw
    try:
        raw = apply_overrides(raw, overrides)
        cfg = _build_checked(raw, path, name)
    except K3ConfigError as e:
        key = _override_for(raw, overrides, e.key)
        if key is None and overrides and _valid(base):       # the file alone is fine: an override broke it
            key = next(iter(overrides)) if len(overrides) == 1 else ", ".join(overrides)
        if key is None:
            raise
        bare = str(e)
        if e.path and bare.startswith(f"{e.path}: "):
            bare = bare[len(e.path) + 2:]
        err = K3ConfigError(bare, path=_override_where(path, key))
        err.key, err.override, err.bare = e.key, key, bare
        raise err from None
    return cfg


def _build_checked(raw: Any, path: str | None, name: str | None) -> ModelConfig:
    """build_config plus the vision_config check (``vision_spec``), so that both fail here."""
    cfg = build_config(raw, path, name)
    if cfg.vision is not None:
        from .vision import vision_spec
        merge, hi = cfg.vision.get("merge_kernel_size"), bounds.UPPER_BOUNDS["vision_config.merge_kernel_size"]
        if isinstance(merge, list) and any(isinstance(k, int) and k > hi for k in merge):
            raise K3ConfigError(f"entries must be <= {hi}, got {_short(merge)}", key="vision_config.merge_kernel_size",
                                path=path)
        vision_spec(cfg.vision, cfg.hidden_size, path)
    return cfg


def _valid(raw: Any) -> bool:
    try:
        _build_checked(raw, None, None)
    except K3ConfigError:
        return False
    return True


#: keys apply_overrides derives from others (the override to blame when they are invalid)
_DERIVED = {"text_hidden_size": ("hidden_size",), "kda_layers": ("num_hidden_layers", "full_attn_layers"),
            "layer_types": ("num_hidden_layers",), "mlp_layer_types": ("num_hidden_layers",),
            "first_k_dense_replace": ("num_hidden_layers",)}


def _override_for(raw: Any, overrides: dict[str, Any] | None, key: str | None) -> str | None:
    """The override key responsible for an error on dotted ``key`` (None: the file's own)."""
    if not overrides or not key or not isinstance(raw, dict):
        return None
    for k in overrides:
        if ".".join(override_path(raw, k)) == key or k == key:
            return k
    last = key.split(".")[-1]
    for k in overrides:
        if k.split(".")[-1] in _DERIVED.get(last, ()):
            return k
    return None
