"""Frontend: config validation, layer schedule, checkpoint key names, parameter totals
(SPEC.md 1: 2,779.5 B total / 104.2 B active for Kimi K3) and the bundled small configs."""
from __future__ import annotations

import json

import pytest
from helpers import kimi_linear_tiny, write_config

import k3ir
from k3ir.accounting import report
from k3ir.errors import K3ConfigError

P = "language_model.model."




@pytest.fixture(scope="module")
def k3():
    return k3ir.load("kimi-k3")


@pytest.fixture(scope="module")
def k3_report(k3):
    return report(k3)


# ---- Kimi K3 ---------------------------------------------------------------------------------
def test_k3_totals(k3_report):
    assert abs(k3_report.params_total / 2779.5e9 - 1) < 5e-4
    assert abs(k3_report.params_active / 104.2e9 - 1) < 5e-4


def test_k3_layer_schedule(k3, k3_report):
    # 1-based full_attn_layers 4, 8, ..., 92 and 93 -> 0-based 3, 7, ..., 91 and 92
    mla = [i for i in range(93) if (i + 1) % 4 == 0] + [92]
    assert mla[:3] == [3, 7, 11] and mla[-3:] == [87, 91, 92] and len(mla) == 24
    assert k3.attrs["mla_layers"] == mla
    assert k3.attrs["kda_layers"] == [i for i in range(93) if i not in mla]
    assert k3_report.counts["kda"] == 69 and k3_report.counts["mla"] == 24
    fwd = k3.functions["forward"]
    assert sorted(op.attrs["layer"] for op in fwd.walk("k3.mla")) == mla
    assert len(list(fwd.walk("k3.kda"))) == 69
    assert k3_report.counts["dense"] == 1 and k3_report.counts["moe"] == 92


def test_k3_parameter_names(k3):
    d, HD, K = 7168, 96 * 128, 4
    shapes = {
        "embed_tokens.weight": [163840, d], "norm.weight": [d],
        "layers.0.mlp.gate_proj.weight": [33792, d], "layers.0.mlp.up_proj.weight": [33792, d],
        "layers.0.mlp.down_proj.weight": [d, 33792],
        "output_attn_res_proj.weight": [1, d], "output_attn_res_norm.weight": [d],
    }
    kda = "layers.1.self_attn."
    shapes.update({kda + "q_proj.weight": [HD, d], kda + "k_proj.weight": [HD, d], kda + "v_proj.weight": [HD, d],
                   kda + "q_conv1d.weight": [HD, 1, K], kda + "k_conv1d.weight": [HD, 1, K],
                   kda + "v_conv1d.weight": [HD, 1, K], kda + "f_a_proj.weight": [128, d],
                   kda + "f_b_proj.weight": [HD, 128], kda + "b_proj.weight": [96, d], kda + "g_proj.weight": [HD, d],
                   kda + "o_norm.weight": [128], kda + "o_proj.weight": [d, HD], kda + "dt_bias": [HD]})
    mla = "layers.3.self_attn."
    shapes.update({mla + "q_a_proj.weight": [1536, d], mla + "q_a_layernorm.weight": [1536],
                   mla + "q_b_proj.weight": [96 * 192, 1536], mla + "kv_a_proj_with_mqa.weight": [576, d],
                   mla + "kv_a_layernorm.weight": [512], mla + "kv_b_proj.weight": [96 * 256, 512],
                   mla + "g_proj.weight": [HD, d], mla + "o_proj.weight": [d, 96 * 128]})
    moe = "layers.5.block_sparse_moe."
    shapes.update({moe + "gate.weight": [896, d], moe + "gate.e_score_correction_bias": [896],
                   moe + "routed_expert_down_proj.weight": [3584, d], moe + "routed_expert_norm.weight": [3584],
                   moe + "routed_expert_up_proj.weight": [d, 3584],
                   moe + "shared_experts.gate_proj.weight": [6144, d], moe + "shared_experts.up_proj.weight": [6144, d],
                   moe + "shared_experts.down_proj.weight": [d, 6144]})
    for i in (5, 92):
        for k in ("self_attention_res_proj.weight", "self_attention_res_norm.weight", "mlp_res_proj.weight",
                  "mlp_res_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            shapes[f"layers.{i}.{k}"] = [1, d] if k.endswith("proj.weight") else [d]
    for key, shape in shapes.items():
        name = P + key
        assert name in k3.params, name
        assert list(k3.params[name].type.shape) == shape, (name, k3.params[name].type)
    assert P + "layers.1.self_attn.A_log" in k3.params
    assert k3.params[P + "layers.1.self_attn.A_log"].type.numel() == 96
    assert "language_model.lm_head.weight" in k3.params
    assert list(k3.params["language_model.lm_head.weight"].type.shape) == [163840, d]
    assert not any(".layers.3.self_attn.q_proj" in n or ".layers.3.mlp." in n for n in k3.params)
    for w, shape in (("w1", [3072, 3584]), ("w2", [3584, 3072]), ("w3", [3072, 3584])):
        decl = k3.params[P + f"layers.5.block_sparse_moe.experts.{{e}}.{w}.weight"]
        keys = decl.keys()
        assert len(keys) == 896
        assert keys[0] == P + f"layers.5.block_sparse_moe.experts.0.{w}.weight"
        assert keys[-1] == P + f"layers.5.block_sparse_moe.experts.895.{w}.weight"
        assert list(decl.key_type().shape) == shape


def test_k3_per_layer_params_by_hand(k3_report):
    d, H, D, E, k = 7168, 96, 128, 896, 16
    HD = H * D
    res = 4 * d                                                        # two AttnRes mixes (w + r each)
    norms = 2 * d                                                      # input / post-attention
    kda = 3 * HD * d + 3 * HD * 4 + D * d + HD * D + H * d + HD * d + H + HD + D + d * HD
    mla = d * 1536 + 1536 + 1536 * H * 192 + d * 576 + 512 + 512 * H * 256 + HD * d + d * HD
    routed = E * 3 * 3072 * 3584
    moe_rest = E * d + E + 3584 * d + 3584 + d * 3584 + 3 * 2 * 3072 * d
    layers = {lr.layer: lr for lr in k3_report.layers}
    assert layers[1].attention == "kda" and layers[3].attention == "mla"
    assert layers[1].params == kda + routed + moe_rest + res + norms
    assert layers[3].params == mla + routed + moe_rest + res + norms
    assert layers[1].params_active == pytest.approx(kda + routed * k / E + moe_rest + res + norms, rel=1e-12)
    assert layers[3].params_active == pytest.approx(mla + routed * k / E + moe_rest + res + norms, rel=1e-12)
    # layer 0: dense SiTU FFN, no AttnRes mix before its attention (no blocks yet)
    assert layers[0].params == kda + 3 * 33792 * d + 2 * d + norms
    assert layers[0].params_active == layers[0].params


# ---- config validation -------------------------------------------------------------------------------
def _tiny_raw():
    from k3ir.frontend.config import read_config
    return read_config("k3-tiny")[0]


@pytest.mark.parametrize("overrides,key,text", [
    ({"linear_attn_config.full_attn_layers": [0, 4, 8]}, "full_attn_layers", "1-based"),
    ({"linear_attn_config.full_attn_layers": [4, 8, 10]}, "full_attn_layers", "out of range"),
    ({"linear_attn_config.full_attn_layers": [4, 8, 9],
      "linear_attn_config.kda_layers": [1, 2, 3, 4, 5, 6, 7]}, "kda_layers", "both"),
    ({"linear_attn_config.full_attn_layers": [4, 8, 9],
      "linear_attn_config.kda_layers": [1, 3, 5, 6, 7]}, "kda_layers", "neither"),
    ({"hidden_size": "sixty-four"}, "hidden_size", "must be int"),
    ({"linear_attn_config.gate_lower_bound": 5.0}, "gate_lower_bound", "negative"),
    ({"num_experts_per_token": 9}, "num_experts_per_token", "exceeds"),
    ({"hidden_act": "gelu"}, "hidden_act", "situ"),
])
def test_config_errors_name_the_key(overrides, key, text):
    with pytest.raises(K3ConfigError) as e:
        k3ir.load("k3-tiny", overrides=overrides)
    msg = str(e.value)
    assert key in msg and text in msg, msg
    assert e.value.key is not None and e.value.key.endswith(key)
    assert "k3-tiny.json" in msg


def test_config_unknown_model_type(tmp_path):
    cfg = kimi_linear_tiny()
    cfg["model_type"] = "llama"
    with pytest.raises(K3ConfigError, match="model_type") as e:
        k3ir.load(write_config(tmp_path, cfg))
    assert "llama" in str(e.value)


def test_config_invalid_json_line_col(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{\n  "vocab_size": 10,\n  "hidden_size": ,\n}\n')       # line 3, column 18
    with pytest.raises(K3ConfigError) as e:
        k3ir.load(str(p))
    assert "line 3, column 18" in str(e.value) and str(p) in str(e.value)


def test_config_missing_file(tmp_path):
    with pytest.raises(K3ConfigError, match="no such file") as e:
        k3ir.load(str(tmp_path / "nope.json"))
    assert "nope.json" in str(e.value)
    with pytest.raises(K3ConfigError, match="config.json"):
        k3ir.load(str(tmp_path))                                  # a directory without config.json


def test_config_missing_key(tmp_path):
    cfg = kimi_linear_tiny()
    del cfg["kv_lora_rank"]
    with pytest.raises(K3ConfigError, match="kv_lora_rank.*required"):
        k3ir.load(write_config(tmp_path, cfg))


# ---- overrides ------------------------------------------------------------------------------------------
def test_overrides_dotted_and_plain():
    m = k3ir.load("k3-tiny", overrides={"linear_attn_config.num_heads": 4, "intermediate_size": 96})
    q = m.params[P + "layers.0.self_attn.q_proj.weight"]
    assert list(q.type.shape) == [4 * 16, 64]
    assert list(m.params[P + "layers.0.self_attn.A_log"].type.shape) == [1, 1, 4, 1]
    assert list(m.params[P + "layers.0.mlp.gate_proj.weight"].type.shape) == [96, 64]
    assert m.config.kda_num_heads == 4 and m.config.intermediate_size == 96


def test_override_hidden_size_plain_config(tmp_path):
    m = k3ir.load(write_config(tmp_path, kimi_linear_tiny()), overrides={"hidden_size": 48})
    assert list(m.params["model.embed_tokens.weight"].type.shape) == [300, 48]
    assert list(m.params["model.layers.0.self_attn.q_proj.weight"].type.shape) == [16, 48]


def test_override_num_hidden_layers_rederives_lists():
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 5})
    # full_attn_layers [4, 8, 9] cut to depth 5 -> [4] -> 0-based [3]
    assert m.attrs["mla_layers"] == [3] and m.attrs["kda_layers"] == [0, 1, 2, 4]
    assert m.attrs["num_hidden_layers"] == 5
    assert not any(".layers.5." in n for n in m.params)
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 12, "linear_attn_config.full_attn_layers": [2, 12]})
    assert m.attrs["mla_layers"] == [1, 11] and len(m.attrs["kda_layers"]) == 10


# ---- Kimi Linear ---------------------------------------------------------------------------------------------
def test_plain_kimi_linear_builds(tmp_path):
    m = k3ir.load(write_config(tmp_path, kimi_linear_tiny()))
    k3ir.verify_module(m)
    fwd = m.functions["forward"]
    names = [op.name for op in fwd.ops]
    assert {op.attrs["form"] for op in fwd.walk("k3.kda_gate")} == {"softplus"}
    assert "k3.attn_res" not in names and "k3.situ_glu" not in names
    assert names.count("k3.swiglu") == 4                  # 1 dense + 3 shared-expert FFNs
    assert {op.attrs["act"] for op in fwd.walk("k3.moe")} == {"silu"}
    assert {op.attrs["routed_scaling_factor"] for op in fwd.walk("k3.router")} == {2.446}
    assert not any("routed_expert_" in n or "_res_" in n for n in m.params)
    assert "model.layers.1.self_attn.q_proj.weight" in m.params          # no q_lora: one q_proj
    assert not any("q_a_proj" in n for n in m.params)
    assert "model.layers.0.self_attn.g_a_proj.weight" in m.params        # low-rank output gate
    assert list(m.params["model.layers.0.self_attn.g_b_proj.weight"].type.shape) == [16, 8]
    assert "model.layers.0.self_attn.g_proj.weight" not in m.params
    assert not any(n.startswith("language_model.") for n in m.params)
    assert m.attrs["mla_layers"] == [1, 3] and m.attrs["kda_gate"] == "softplus"


def test_kimi_linear_6p6b_params_by_hand():
    m = k3ir.load("kimi-linear-6p6b")
    d, L, V, I_dense = 2048, 16, 32000, 8192
    H, D = 16, 128
    HD = H * D
    kda = 3 * HD * d + 3 * HD * 4 + D * d + HD * D + H * d + D * d + HD * D + H + HD + D + d * HD
    mla = H * 192 * d + 576 * d + 512 + H * 256 * 512 + d * H * 128
    moe = 64 * d + 64 + 64 * 3 * 1024 * d + 3 * 1024 * d
    dense = 3 * I_dense * d
    n_mla, n_kda = 4, 12
    total = (n_kda * kda + n_mla * mla + dense + (L - 1) * moe + L * 2 * d + 2 * V * d + d)
    r = report(m)
    assert r.params_total == total
    assert 6.5e9 < total < 6.7e9
    assert r.counts == {"kda": 12, "mla": 4, "moe": 15, "dense": 1}


# ---- k3-tiny -----------------------------------------------------------------------------------------------------
def test_k3_tiny_structure():
    m = k3ir.load("k3-tiny")
    c = m.config
    n, B = c.num_hidden_layers, c.attn_res_block_size
    assert n % B != 0                                     # the last block is partial
    assert c.mla_layers == [3, 7, 8]                      # 3:1, the two adjacent MLA layers at the end
    assert c.first_k_dense_replace == 1 and c.latent_size and c.num_shared_experts >= 1
    assert c.gate_lower_bound == -5.0 and c.hidden_act == "situ" and c.q_lora_rank
    assert c.vocab_size >= 256 + 3 and all(256 <= t < c.vocab_size for t in (c.bos_token_id, c.eos_token_id))
    fwd = m.functions["forward"]
    assert {op.attrs["form"] for op in fwd.walk("k3.kda_gate")} == {"lower_bound"}
    assert len(list(fwd.walk("k3.situ_glu"))) == 1 + (n - 1)          # dense FFN + shared experts
    assert P + "layers.0.mlp.gate_proj.weight" in m.params
    assert not any(".layers.0.block_sparse_moe" in x for x in m.params)
    assert P + "layers.1.block_sparse_moe.routed_expert_down_proj.weight" in m.params
    # AttnRes sources per mix: snapshots at layers 0, B, 2B, ... plus the partial sum
    got = [(op.attrs.get("layer"), len(op.operands) - 2) for op in fwd.walk("k3.attn_res")]
    want = []
    for i in range(n):
        if i >= 1:
            want.append((i, len([j for j in range(i) if j % B == 0]) + 1))
        want.append((i, len([j for j in range(i + 1) if j % B == 0]) + 1))
    want.append((None, len([j for j in range(n) if j % B == 0]) + 1))
    assert got == want
    assert want[-1][1] == 4                              # blocks at 0, 4, 8 + the last partial sum


# ---- hostile configs: every failure is a K3ConfigError naming the file and the key (or line and column) ----------
def _tiny_raw() -> dict:
    from k3ir.frontend.config import resolve_config_path
    with open(resolve_config_path("k3-tiny")) as f:
        return json.load(f)


def _load_text(tmp_path, text: str | bytes) -> K3ConfigError:
    p = tmp_path / "config.json"
    p.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    with pytest.raises(K3ConfigError) as e:
        k3ir.load(str(p))
    assert str(e.value).startswith(f"{p}: "), str(e.value)
    return e.value


def test_config_not_utf8_names_line_and_column(tmp_path):
    text = json.dumps(_tiny_raw(), indent=2).encode()
    i = text.index(b'"hidden_size"')                 # on line 3 of the indented file, after 4 spaces
    bad = text[:i + 3] + b"\xff" + text[i + 3:]
    line = text.count(b"\n", 0, i) + 1
    e = _load_text(tmp_path, bad)
    assert f"not valid UTF-8 at line {line}, column 8 (byte 0xff" in str(e), str(e)


@pytest.mark.parametrize("n", [33, 5000])
def test_config_nesting_depth(tmp_path, n):
    raw = _tiny_raw()
    text = json.dumps(raw).replace('"hidden_size": 64', '"hidden_size": ' + "[" * n + "]" * n)
    col = text.index('"hidden_size"') + len('"hidden_size": ') + 1 + 30   # the 31st '[' is level 33 (the file's object and text_config are 1 and 2)
    e = _load_text(tmp_path, text)
    assert f"JSON nested more than 32 deep at line 1, column {col}" in str(e), str(e)


def test_config_nesting_at_the_limit_reaches_the_key(tmp_path):
    text = json.dumps(_tiny_raw()).replace('"hidden_size": 64', '"hidden_size": ' + "[" * 30 + "]" * 30)
    e = _load_text(tmp_path, text)        # 30 + the two objects around it = 32 levels: parsed, then typed
    assert "key 'text_config.hidden_size': must be int, got list" in str(e), str(e)


@pytest.mark.parametrize("digits", [20, 31, 5000])
def test_config_huge_integer_names_the_key(tmp_path, digits):
    text = json.dumps(_tiny_raw()).replace('"kv_lora_rank": 32', '"kv_lora_rank": ' + "1" + "0" * (digits - 1))
    e = _load_text(tmp_path, text)
    assert "key 'text_config.kv_lora_rank': integer " in str(e) and "is out of the 64-bit range" in str(e), str(e)
    assert e.key == "text_config.kv_lora_rank"


def test_config_huge_integer_for_a_float_key(tmp_path):
    raw = _tiny_raw()
    raw["text_config"]["routed_scaling_factor"] = 10 ** 400       # float(10**400) overflows
    with pytest.raises(K3ConfigError, match="text_config.routed_scaling_factor"):
        k3ir.frontend.build_config(raw, "c.json")


@pytest.mark.parametrize("key,value,bound", [
    ("num_hidden_layers", 2 ** 31, 1024), ("hidden_size", 65537, 65536), ("vocab_size", 2 ** 22 + 1, 2 ** 22),
    ("num_experts", 10 ** 6, 16384), ("kv_lora_rank", 10 ** 12, 65536),
    ("linear_attn_config.head_dim", 4097, 4096), ("vision_config.vt_num_hidden_layers", 2 ** 31, 1024),
])
def test_config_file_upper_bounds(tmp_path, key, value, bound):
    raw = _tiny_raw()
    node = raw if key.startswith("vision_config") else raw["text_config"]
    *head, last = key.split(".")
    for h in head:
        node = node[h]
    node[last] = value
    e = _load_text(tmp_path, json.dumps(raw))
    assert f"must be <= {bound}, got {value}" in str(e), str(e)
    assert e.key.removeprefix("text_config.") == key


def test_config_upper_bounds_hold_kimi_k3_twice():
    """Every bound is at least twice Kimi K3's value (a larger K3-family model still loads)."""
    from k3ir.frontend.config import resolve_config_path
    from k3ir.frontend.config_bounds import UPPER_BOUNDS
    with open(resolve_config_path("kimi-k3")) as f:
        raw = json.load(f)
    seen = 0
    for key, hi in UPPER_BOUNDS.items():
        node, parts = raw if key.startswith("vision_config") else raw["text_config"], key.split(".")
        for p in parts:
            node = node.get(p) if isinstance(node, dict) else None
        for v in node if isinstance(node, list) else [node]:
            if isinstance(v, int):
                assert hi >= 2 * v, (key, v, hi)
                seen += 1
    assert seen >= 30


@pytest.mark.parametrize("key,value,words", [
    ("num_hidden_layers", 2 ** 31, "2147483648 exceeds the largest supported num_hidden_layers (1024"),
    ("kv_lora_rank", 10 ** 30, "integer 1000000000000000000000000000000 is out of the 64-bit range"),
    ("linear_attn_config.num_heads", 10 ** 5000, "integer of 16610 bits is out of the 64-bit range"),
], ids=["layers-2**31", "kv_lora_rank-10**30", "num_heads-10**5000"])
def test_override_bounds_fail_fast(key, value, words):
    import time
    t0 = time.perf_counter()
    with pytest.raises(K3ConfigError) as e:
        k3ir.load("k3-tiny", overrides={key: value})
    assert time.perf_counter() - t0 < 5
    assert e.value.override == key and words in str(e.value) and "k3-tiny.json, override" in str(e.value), str(e.value)


@pytest.mark.parametrize("text,want", [
    ("1" + "0" * 5000, "HugeInt"), ("[" * 5000 + "]" * 5000, "str"), ("2**31", "str"), ("12", "int"),
], ids=["5000-digits", "5000-deep", "expression", "int"])
def test_parse_override_value_never_raises(text, want):
    from k3ir.frontend import parse_override_value
    assert type(parse_override_value(text)).__name__ == want


def test_layer_types_with_non_integer_full_attn_layers(tmp_path):
    """transformers' layer_types next to a full_attn_layers entry that is not an int: the entry is named."""
    cfg = kimi_linear_tiny()
    cfg["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg["linear_attn_config"]["full_attn_layers"] = [2, [4]]
    with pytest.raises(K3ConfigError, match=r"linear_attn_config.full_attn_layers': entry 1 must be an integer, "
                                            r"got \[4\]"):
        k3ir.load(write_config(tmp_path, cfg))


@pytest.mark.parametrize("overrides,key,words", [
    ({"text_config": [1, 0]}, "text_config", "must be an object"),
    ({"text_config": [1, 0], "vocab_size": 300}, "vocab_size", "'text_config' is not an object"),
    ({"quantization_config": {"format": [0, 1, 2]}}, "quantization_config.format", "unsupported format [0, 1, 2]"),
    ({"eos_token_id": []}, "eos_token_id", "must not be an empty list"),
], ids=["text_config-list", "text_config-list-vocab", "quant-format-list", "eos-empty"])
def test_override_wrong_shapes_name_the_key(overrides, key, words):
    with pytest.raises(K3ConfigError) as e:
        k3ir.load("k3-tiny", overrides=overrides)
    assert e.value.key.endswith(key) and words in str(e.value), str(e.value)


def test_config_depth_scan_is_linear(tmp_path):
    """An unterminated string of 10^6 escaped quotes: the nesting pre-scan does not restart at each quote
    (quadratic) but reports the invalid JSON at once."""
    import time
    t0 = time.perf_counter()
    e = _load_text(tmp_path, '{"a": "' + '\\"' * 10 ** 6)
    assert time.perf_counter() - t0 < 5 and "invalid JSON at line 1" in str(e), str(e)[:300]
