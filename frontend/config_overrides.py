"""The ``--set key=value`` override policy: how a value is parsed, which keys an override may name, where a
dotted key lands in the config, which keys follow it, and which override an error is blamed on.

``parse_override_value`` parses the text, ``check_override_keys`` refuses unknown or ignored keys
(with a close match), ``apply_overrides`` sets the keys and re-derives those that depend on them
(layer lists, duplicated HF keys, special token ids, the vision projector width), and
``_override_for`` names the override responsible for a K3ConfigError of the overridden config.
"""
from __future__ import annotations

import copy
import difflib
import json
from typing import Any

from k3ir.errors import K3ConfigError

from . import config_bounds as bounds
from .config_keys import (
    HF_EXTRAS,
    LAC_KEYS,
    LAC_MIRRORS,
    TEXT_KEYS,
    TOKEN_ID_KEYS,
    VISION_KEYS,
    WRAPPER_KEYS,
    _ignored_key,
    _known,
)


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


def _override_where(path: str | None, key: str) -> str:
    return f"{path}, override '{key}'" if path else f"override '{key}'"


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
