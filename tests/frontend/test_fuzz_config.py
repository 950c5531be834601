"""Fuzzed configs: mutations of the bundled config.json files (byte flips, deletions, duplications, invalid
UTF-8, huge integers, deep nesting, values of any type at any key) and of ``--set`` values either load or
fail with a K3ConfigError that names the file and where in it (a key, an override, or a line and column);
never with another exception type, and never slowly (bounds are checked before anything loops).

Examples per test come from the hypothesis profile (tests/conftest.py: ``suite`` by default,
``--hypothesis-profile=fuzz-long`` for thousands; scripts/fuzz_readers.sh runs that)."""
from __future__ import annotations

import json
import logging
import time

import helpers
import pytest
from hypothesis import given
from hypothesis import strategies as st
from k3ir.frontend import build_module, load_config, parse_override_value
from k3ir.frontend.config import LAC_KEYS, TEXT_KEYS, VISION_KEYS, resolve_config_path

import k3ir
from k3ir.errors import K3ConfigError, K3Error

BUNDLED = ["k3-tiny", "kimi-linear-6p6b", "kimi-k3"]
#: models small enough to build per example (kimi-k3's 93 layers take seconds: its configs are only validated)
BUILD = {"k3-tiny", "kimi-linear-6p6b"}


@pytest.fixture(scope="module")
def sources() -> dict[str, bytes]:
    out = {}
    for name in BUNDLED:
        with open(resolve_config_path(name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_config")


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    """Unknown keys the mutations create are logged as warnings; keep the output readable."""
    logger = logging.getLogger("k3ir.config")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def located(e: K3Error, path: str) -> None:
    """``e`` names the file and where in it: a key, an override, or a line and column."""
    msg = str(e)
    assert isinstance(e, K3ConfigError) and msg.startswith(path), msg[:500]
    where = getattr(e, "override", None) or e.key or " line " in msg or "config must be a JSON object" in msg \
        or "larger than" in msg
    assert where, msg[:500]


def load(path: str, name: str, overrides: dict | None = None) -> K3Error | None:
    """load_config (+ build_module for the small models); the K3Error raised, or None. Other exceptions fail
    the test; so does an example slower than 20 s (a loop by an unchecked size)."""
    t0 = time.perf_counter()
    try:
        cfg = load_config(path, overrides)
        if name in BUILD:
            build_module(cfg)
    except K3Error as e:
        located(e, path)
        return e
    finally:
        assert time.perf_counter() - t0 < 20, overrides
    return None


# ---- byte mutations -----------------------------------------------------------------------------------------
EDITS = st.lists(st.tuples(st.sampled_from(["flip", "set", "delete", "duplicate", "digits", "nest", "utf8"]),
                           st.integers(0, 2 ** 20), st.integers(1, 6000), st.integers(0, 255)), min_size=1, max_size=3)


def _config_edit(b: bytearray, kind: str, i: int, n: int, byte: int) -> None:
    """The config-specific kinds: ``digits``, ``nest`` and ``utf8`` (invalid UTF-8; also a flip or set at the end)."""
    if kind == "digits":            # a number becomes n digits long (or one is inserted)
        j = i
        while j < len(b) and chr(b[j]).isdigit():
            j += 1
        b[i:j] = b"1" + b"0" * (n - 1)
    elif kind == "nest":
        b[i:i] = (b"[" if byte % 2 else b'{"a": ') * (n % 200 + 1)
    else:
        b[i:i] = bytes([0x80 | byte % 64, 0xC3, byte])[: n % 3 + 1]


def edit_bytes(data: bytes, edits) -> bytes:
    return helpers.edit_bytes(data, edits, span=lambda n: n % 64 + 1, more=_config_edit)


@given(name=st.sampled_from(BUNDLED), edits=EDITS)
def test_byte_mutations(sources, workdir, name, edits):
    """Byte-level damage: invalid UTF-8, broken JSON, numbers of thousands of digits, deep nesting."""
    p = workdir / "config.json"
    p.write_bytes(edit_bytes(sources[name], edits))
    load(str(p), name)


# ---- value mutations -----------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.one_of(st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -1, 1, 2, 3, 4, 16, 1024, 1025, 65536, 2 ** 31,
                                                                2 ** 63, 10 ** 30, 10 ** 400]),
              st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
              st.sampled_from(["", "x", "bf16", "situ", "full_attention", "mxfp4-pack-quantized", "re:("])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "format", "ignore"]),
                                                                          inner, max_size=2)),
    max_leaves=8)


def _paths(node, pre=()):
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append(pre + (k,))
        out += _paths(v, pre + (k,))
    return out


@given(name=st.sampled_from(BUNDLED),
       edits=st.lists(st.tuples(st.integers(0, 2 ** 20), st.sampled_from(["set", "delete"]), JSON_VALUES),
                      min_size=1, max_size=3))
def test_value_mutations(sources, workdir, name, edits):
    """Any key's value replaced by any JSON value (or the key deleted): wrong types, huge or negative sizes,
    NaN, lists where numbers belong... Written as Python's json writes them (NaN / Infinity included)."""
    raw = json.loads(sources[name])
    for pick, kind, value in edits:
        paths = _paths(raw)
        if not paths:
            break
        *head, last = paths[pick % len(paths)]
        node = raw
        for k in head:
            node = node[k]
        if kind == "delete" and isinstance(node, dict):
            del node[last]
        else:
            node[last] = value
    p = workdir / "config.json"
    p.write_text(json.dumps(raw))
    load(str(p), name)


# ---- --set values -----------------------------------------------------------------------------------------------
SET_KEYS = (sorted(TEXT_KEYS) + [f"linear_attn_config.{k}" for k in sorted(LAC_KEYS)]
            + [f"vision_config.{k}" for k in sorted(VISION_KEYS)] + ["text_config", "quantization_config.format"])
SET_TEXTS = st.one_of(
    st.integers(-2 ** 70, 2 ** 70).map(str),
    st.sampled_from(["2**31", "10**30", "2147483648", "1e400", "NaN", "-Infinity", "null", "[]", "{}", "true",
                     "1" + "0" * 5000, "[" * 5000 + "]" * 5000, '{"a":' * 3000, "\udcff", "1024", "1025"]),
    JSON_VALUES.map(json.dumps),
    st.text(max_size=20),
)


@given(name=st.sampled_from(sorted(BUILD)), sets=st.lists(st.tuples(st.sampled_from(SET_KEYS), SET_TEXTS),
                                                             min_size=1, max_size=3))
def test_set_values(name, sets):
    """``--set KEY=TEXT`` as the CLI reads it (parse_override_value, then load_config with the overrides):
    Python-style expressions, 5,000-digit numbers, 5,000-deep lists, out-of-range sizes, any JSON."""
    overrides = {key: parse_override_value(text) for key, text in sets}
    e = load(resolve_config_path(name), name, overrides)
    if e is not None:
        assert e.override is not None or e.key is not None, str(e)[:500]


def test_set_values_kimi_k3_bounds_fast():
    """The overrides of the issue on the big model: refused before any layer loop (well under a second)."""
    for key, value in [("num_hidden_layers", 2 ** 31), ("kv_lora_rank", 10 ** 30), ("num_experts", 10 ** 9)]:
        t0 = time.perf_counter()
        with pytest.raises(K3ConfigError) as e:
            k3ir.load("kimi-k3", overrides={key: value})
        assert time.perf_counter() - t0 < 2 and e.value.override == key, str(e.value)
