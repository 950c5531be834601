"""HF-style config.json -> validated ModelConfig (SPEC.md section 1).

Accepts the ``kimi_k3`` wrapper (``text_config`` + ``vision_config``) and a plain
``kimi_linear`` config. Every error names the file and the key (``K3ConfigError``).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3ConfigError

BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "configs")
BUNDLED = {"kimi-k3": "kimi-k3.json", "k3-tiny": "k3-tiny.json", "kimi-linear-6p6b": "kimi-linear-6p6b.json"}

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
            raise K3ConfigError("directory has no config.json", path=name_or_path)
        return p
    if os.path.isfile(name_or_path):
        return name_or_path
    raise K3ConfigError(f"no such file, directory or bundled model (bundled: {', '.join(BUNDLED)})",
                        path=name_or_path)


def read_config(name_or_path: str) -> tuple[dict, str]:
    path = resolve_config_path(name_or_path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), path
    except json.JSONDecodeError as e:
        raise K3ConfigError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}", path=path) from None
    except OSError as e:
        raise K3ConfigError(f"cannot read: {e.strerror}", path=path) from None


def parse_override_value(text: str) -> Any:
    """``--set key=value``: JSON when it parses (numbers, true/false/null, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(raw: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys. For a ``kimi_k3`` wrapper, keys not starting with ``text_config.``/
    ``vision_config.`` (or naming a top-level key) go to ``text_config``; dotted keys reach
    ``linear_attn_config``. Overriding ``num_hidden_layers`` alone re-derives the layer lists
    (MLA layers beyond the new depth dropped; KDA = the complement); overriding ``hidden_size``
    alone also sets ``vision_config.text_hidden_size`` (the projector's output width)."""
    if not overrides:
        return raw
    cfg = copy.deepcopy(raw)
    wrapped = "text_config" in cfg
    for key, value in overrides.items():
        parts = key.split(".")
        if wrapped and parts[0] not in ("text_config", "vision_config") and parts[0] not in cfg:
            parts = ["text_config"] + parts
        node = cfg
        for p in parts[:-1]:
            if p not in node or not isinstance(node[p], dict):
                if p in node:
                    raise K3ConfigError(f"cannot set '{key}': '{p}' is not an object", key=key)
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    text = cfg["text_config"] if wrapped else cfg
    keys = {k.split(".")[-1] for k in overrides}
    vision = cfg.get("vision_config") if wrapped else None
    if ("hidden_size" in keys and isinstance(vision, dict) and "text_hidden_size" in vision
            and not any(k.endswith("text_hidden_size") for k in overrides)):
        vision["text_hidden_size"] = text.get("hidden_size")      # the projector follows the text width
    lac = text.get("linear_attn_config")
    if "num_hidden_layers" in keys and isinstance(lac, dict) and "full_attn_layers" not in keys:
        n = text["num_hidden_layers"]
        if isinstance(n, int):
            lac["full_attn_layers"] = [i for i in lac.get("full_attn_layers", []) if isinstance(i, int) and i <= n]
            lac["kda_layers"] = [i for i in range(1, n + 1) if i not in lac["full_attn_layers"]]
    elif "full_attn_layers" in keys and isinstance(lac, dict) and "kda_layers" not in keys:
        n = text.get("num_hidden_layers")
        if isinstance(n, int) and isinstance(lac.get("full_attn_layers"), list):
            lac["kda_layers"] = [i for i in range(1, n + 1) if i not in lac["full_attn_layers"]]
    return cfg


class _Reader:
    """Typed access to a config dict; errors name the dotted key and the file."""

    def __init__(self, d: dict, prefix: str, path: str | None):
        self.d, self.prefix, self.path = d, prefix, path

    def key(self, k: str) -> str:
        return f"{self.prefix}{k}"

    def fail(self, k: str, msg: str):
        raise K3ConfigError(msg, key=self.key(k), path=self.path)

    def get(self, k: str, typ, default: Any = ..., *, lo=None, hi=None, allow_none=False, choices=None):
        if k not in self.d or (self.d[k] is None and not allow_none and default is not ...):
            if default is ...:
                self.fail(k, "is required")
            return default
        v = self.d[k]
        if v is None:
            if allow_none:
                return None
            self.fail(k, "must not be null")
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if typ is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            self.fail(k, f"must be {typ.__name__}, got {type(v).__name__} {v!r}")
        if choices is not None and v not in choices:
            self.fail(k, f"must be one of {list(choices)}, got {v!r}")
        if lo is not None and v < lo:
            self.fail(k, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            self.fail(k, f"must be <= {hi}, got {v}")
        return v


def build_config(raw: dict, path: str | None = None, name: str | None = None) -> ModelConfig:
    if not isinstance(raw, dict):
        raise K3ConfigError("config must be a JSON object", path=path)
    mt = raw.get("model_type")
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
    r = _Reader(text, prefix, path)
    n_layers = r.get("num_hidden_layers", int, lo=1)
    hidden = r.get("hidden_size", int, lo=1)
    lac = _linear_attn_config(text, r, n_layers)
    la = _Reader(lac, prefix + "linear_attn_config.", path)
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
    dtype_name = r.get("dtype", str, r.get("torch_dtype", str, "bfloat16"))
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
    return ModelConfig(
        name=name or os.path.splitext(os.path.basename(path or "model"))[0],
        model_type=model_type, key_prefix=kp,
        vocab_size=r.get("vocab_size", int, lo=1), hidden_size=hidden, num_hidden_layers=n_layers,
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6, lo=0.0),
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        dtype=_DTYPES[dtype_name],
        bos_token_id=text.get("bos_token_id"), eos_token_id=text.get("eos_token_id"),
        pad_token_id=text.get("pad_token_id"),
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


def _linear_attn_config(text: dict, r: _Reader, n_layers: int) -> dict:
    """``linear_attn_config``, or one derived from the keys transformers' ``KimiLinearConfig``
    writes (``layer_types``, ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``);
    when both are present, ``layer_types`` must agree with ``full_attn_layers``."""
    lt = text.get("layer_types")
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
    if lt is not None and isinstance(full, list) and sorted(full) != [i + 1 for i, t in enumerate(lt)
                                                                      if t == "full_attention"]:
        r.fail("layer_types", f"disagrees with linear_attn_config.full_attn_layers {full} (1-based)")
    return lac


def _first_dense(text: dict, r: _Reader, n_layers: int) -> int:
    """``first_k_dense_replace``; transformers' ``mlp_layer_types`` must be that many ``dense``
    then ``sparse`` (and gives the count when the key is absent)."""
    mt = text.get("mlp_layer_types")
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
    qc = text.get("quantization_config")
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
    if fmt not in known:
        r.fail("quantization_config.format", f"unsupported format {fmt!r} (want one of {sorted(known)})")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        r.fail("quantization_config.ignore", "must be a list of strings")
    return known[fmt], list(ignore)


def load_config(name_or_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """Read, override and validate a config (bundled name, config.json, or checkpoint dir)."""
    raw, path = read_config(name_or_path)
    raw = apply_overrides(raw, overrides)
    name = name_or_path if name_or_path in BUNDLED else None
    if name is None and os.path.isdir(name_or_path):
        name = os.path.basename(os.path.normpath(name_or_path))
    return build_config(raw, path, name)
