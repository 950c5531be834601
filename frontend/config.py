"""HF-style config.json -> validated ModelConfig (SPEC.md section 1).

Accepts the ``kimi_k3`` wrapper (``text_config`` + ``vision_config``) and a plain
``kimi_linear`` config. Every error names the file and the key (``K3ConfigError``). Sizes, integer
ranges and JSON nesting are bounded before anything loops or allocates (``config_bounds.py``).

This module finds and reads the file (``resolve_config_path``, ``read_config``), validates it into
``ModelConfig`` (``build_config``) and ties the steps together (``load_config``). The jobs around it:
``config_reader.py`` (typed reads of one level, ``_Reader``), ``config_keys.py`` (which HF keys are
read, ignored, duplicated or refused), ``config_overrides.py`` (the ``--set`` policy). Their public
names are importable from here.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from k3ir.errors import K3ConfigError

from . import config_bounds as bounds
from .config_keys import (
    HF_EXTRAS,
    LAC_KEYS,
    LAC_MIRRORS,
    SUPPORTED_FORMATS,
    TEXT_KEYS,
    TOKEN_ID_KEYS,
    UNSERVED_FAMILY,
    VISION_KEYS,
    WRAPPER_KEYS,
    _check_ignored_keys,
    _warn_unknown,
    check_family_format,
)
from .config_overrides import (
    _override_for,
    _override_where,
    apply_overrides,
    check_override_keys,
    override_path,
    parse_override_value,
)
from .config_reader import NULL_MEANS_DEFAULT, _Reader, _short
from .run_pointer import pointer_message
from .vision import vision_spec

__all__ = [
    "BUNDLED", "BUNDLED_DIR", "HF_EXTRAS", "LAC_KEYS", "LAC_MIRRORS", "NULL_MEANS_DEFAULT", "SUPPORTED_FORMATS",
    "TEXT_KEYS", "TOKEN_ID_KEYS", "UNSERVED_FAMILY", "VISION_KEYS", "WRAPPER_KEYS", "ModelConfig", "apply_overrides",
    "build_config", "check_family_format", "check_override_keys", "load_config", "override_path",
    "parse_override_value", "read_config", "resolve_config_path",
]

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
        raise K3ConfigError(pointer_message(path) or f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                            path=path) from None
    bounds.check_huge(raw, path)
    return raw, path


def build_config(raw: dict, path: str | None = None, name: str | None = None,
                 reads: set[str] | None = None) -> ModelConfig:
    """Validate ``raw`` (a config dict) into a ModelConfig; K3ConfigError names ``path`` and the
    key. ``reads``, when given, collects the dotted keys the reader looked at."""
    if not isinstance(raw, dict):
        raise K3ConfigError("config must be a JSON object", path=path)
    check_family_format(raw, path)
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
