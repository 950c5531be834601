"""Limits on what a config.json (or a ``--set`` value) may say, checked before anything is built from it.

A config may come from anywhere (a downloaded checkpoint, a mistyped ``--set``), and the builder
loops over layers and allocates per dimension, so the reader checks these first:

- the file: at most ``MAX_CONFIG_BYTES`` bytes, UTF-8, JSON nested at most ``MAX_JSON_DEPTH`` deep
  (counted on the text, before the JSON parser recurses);
- every integer: a signed 64-bit value (``MAX_INT_DIGITS`` digits are counted before ``int()``
  converts them, so a 5,000-digit literal costs nothing);
- each size key: at most its ``UPPER_BOUNDS`` entry.

UPPER_BOUNDS are generous on purpose: at least 2x Kimi K3's value (in the comments) and enough for
any K3-family model (Kimi Linear, scaled variants); a config beyond them is a typo or an attack.
Errors are K3ConfigError naming the file and the dotted key (or the line and column of the text).
"""
from __future__ import annotations

import json
import re
from typing import Any

from k3ir.errors import K3ConfigError

#: largest config file read (bytes); real ones are a few kB
MAX_CONFIG_BYTES = 16 * 2 ** 20
#: deepest nesting of JSON objects / arrays (the bundled configs use 3)
MAX_JSON_DEPTH = 32
#: integers are signed 64-bit; longer digit strings are refused before conversion
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_INT_DIGITS = len(str(INT_MAX))

#: dotted key (relative to the text config; ``vision_config.`` for the vision tower) -> largest value.
#: Comments give Kimi K3's value.
UPPER_BOUNDS: dict[str, int] = {
    "num_hidden_layers": 1024,                     # 93
    "hidden_size": 65536,                          # 7168
    "vocab_size": 2 ** 22,                         # 163840
    "intermediate_size": 262144,                   # 33792
    "moe_intermediate_size": 65536,                # 3072
    "routed_expert_hidden_size": 65536,            # 3584
    "num_experts": 16384,                          # 896
    "num_experts_per_token": 1024,                 # 16
    "num_shared_experts": 64,                      # 2
    "num_expert_group": 1024,                      # 1
    "num_attention_heads": 1024,                   # 96
    "num_key_value_heads": 1024,                   # 96
    "q_lora_rank": 65536,                          # 1536
    "kv_lora_rank": 65536,                         # 512
    "qk_nope_head_dim": 4096,                      # 128
    "qk_rope_head_dim": 4096,                      # 64
    "v_head_dim": 4096,                            # 128
    "attn_res_block_size": 1024,                   # 12
    "linear_attn_config.num_heads": 1024,          # 96
    "linear_attn_config.head_dim": 4096,           # 128
    "linear_attn_config.short_conv_kernel_size": 64,   # 4
    "linear_num_heads": 1024,                      # (Kimi Linear's flat keys)
    "linear_head_dim": 4096,
    "linear_conv_kernel_dim": 64,
    "vision_config.vt_hidden_size": 65536,         # 1152
    "vision_config.vt_num_hidden_layers": 1024,    # 27
    "vision_config.vt_num_attention_heads": 1024,  # 16
    "vision_config.vt_intermediate_size": 262144,  # 4304
    "vision_config.mm_hidden_size": 65536,         # 1152
    "vision_config.text_hidden_size": 65536,       # 7168
    "vision_config.patch_size": 1024,              # 14
    "vision_config.init_pos_emb_height": 16384,    # 64
    "vision_config.init_pos_emb_width": 16384,     # 64
    "vision_config.init_pos_emb_time": 1024,       # 4
    "vision_config.merge_kernel_size": 64,         # [2, 2] (each entry)
}


def upper_bound(key: str) -> int | None:
    """The UPPER_BOUNDS entry of a dotted key as the reader names it (``text_config.`` dropped), or None."""
    return UPPER_BOUNDS.get(key.removeprefix("text_config."))


class HugeInt:
    """An integer literal outside the signed 64-bit range, kept as its digit count (never converted)."""

    __slots__ = ("digits", "text")

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))
        self.text = text if self.digits <= 40 else f"{text[:12]}...({self.digits} digits)"

    def __repr__(self) -> str:
        return self.text


def _parse_int(text: str) -> int | HugeInt:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return HugeInt(text)
    v = int(text)
    return v if INT_MIN <= v <= INT_MAX else HugeInt(text)


#: a JSON string (an unterminated one runs to the end of the text, so that the scan stays linear) or a bracket
_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def check_depth(text: str, where: str | None, what: str = "") -> None:
    """K3ConfigError at the line and column where ``text``'s JSON nesting passes MAX_JSON_DEPTH
    (strings are skipped; unbalanced brackets are left to the JSON parser)."""
    depth = 0
    for m in _NESTING.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                line, col = _line_col(text, m.start())
                raise K3ConfigError(f"{what}JSON nested more than {MAX_JSON_DEPTH} deep at line {line}, column {col}",
                                    path=where)
        elif c in "]}":
            depth -= 1


def decode_utf8(data: bytes, path: str) -> str:
    """``data`` as text; K3ConfigError naming the line, column and byte of the first invalid UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        start = data.rfind(b"\n", 0, e.start) + 1
        col = len(data[start:e.start].decode("utf-8", errors="replace")) + 1
        raise K3ConfigError(f"not valid UTF-8 at line {line}, column {col} (byte 0x{data[e.start]:02x}: {e.reason})",
                            path=path) from None


def loads(text: str, where: str | None, what: str = "") -> Any:
    """``json.loads`` after ``check_depth``; integers outside 64 bits become HugeInt (``find_huge`` names
    them). Raises json.JSONDecodeError for invalid JSON, K3ConfigError for deep nesting."""
    check_depth(text, where, what)
    return json.loads(text, parse_int=_parse_int)


def find_huge(value: Any, prefix: str = "") -> tuple[str, HugeInt] | None:
    """The dotted key and value of the first HugeInt in ``value`` (dicts and lists, walked without
    recursion), or None."""
    stack: list[tuple[str, Any]] = [(prefix, value)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, HugeInt):
            return key, v
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{key}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def check_huge(raw: Any, path: str | None) -> None:
    """K3ConfigError naming the key of the first integer outside the signed 64-bit range in ``raw``."""
    found = find_huge(raw)
    if found is not None:
        key, v = found
        raise K3ConfigError(f"integer {v.text} is out of the 64-bit range", key=key or None, path=path)


def check_override_value(key: str, value: Any, where: str) -> None:
    """An override's value before it is applied: no integer outside 64 bits (also Python ints given to
    ``k3ir.load(overrides=...)``) and a bounded key within its UPPER_BOUNDS entry, so that nothing
    loops or allocates by it. Raises K3ConfigError with ``.override`` = ``key``."""
    def fail(msg: str) -> None:
        err = K3ConfigError(msg, path=where)
        err.override, err.bare = key, msg
        raise err
    found = find_huge(value)
    if found is not None:
        fail(f"integer {found[1].text} is out of the 64-bit range")
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= INT_MAX:
            fail(f"integer {v if v.bit_length() <= 100 else f'of {v.bit_length()} bits'} is out of the 64-bit range")
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    hi = upper_bound(key)
    if hi is not None and isinstance(value, int) and not isinstance(value, bool) and value > hi:
        fail(f"{value} exceeds the largest supported {key.split('.')[-1]} ({hi}; see frontend/config_bounds.py)")
