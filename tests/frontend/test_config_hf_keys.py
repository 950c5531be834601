"""Hugging Face config keys that k3ir reads through another key or ignores: a flat duplicate (``linear_num_heads``,
``qk_head_dim``, ...) that contradicts the key k3ir reads is refused naming both, ``--set`` of a duplicate changes
the model, ``--set`` of an ignored key that would change the architecture is refused, and a whole
``linear_attn_config`` override carries the flat duplicates along."""
from __future__ import annotations

import json

import pytest
from conftest import one_line_error, run_cli
from k3ir.frontend.config import resolve_config_path

import k3ir


def _linear_file(tmp_path, **changes) -> str:
    with open(resolve_config_path("kimi-linear-6p6b")) as f:
        raw = json.load(f)
    raw.update(changes)
    p = tmp_path / "lin.json"
    p.write_text(json.dumps(raw))
    return str(p)


@pytest.mark.parametrize("changes,key,msg", [
    ({"linear_num_heads": 4}, "linear_num_heads",
     ("4 disagrees with linear_attn_config.num_heads = 32 (k3ir reads linear_attn_config; set both or drop "
     "linear_num_heads)")),
    ({"linear_head_dim": 64}, "linear_head_dim", "64 disagrees with linear_attn_config.head_dim = 128"),
    ({"linear_conv_kernel_dim": 3}, "linear_conv_kernel_dim",
     "3 disagrees with linear_attn_config.short_conv_kernel_size = 4"),
    ({"qk_head_dim": 7}, "qk_head_dim", "7 disagrees with qk_nope_head_dim + qk_rope_head_dim = 128 + 64 = 192"),
    ({"moe_layer_freq": 2}, "moe_layer_freq", "only 1 is supported"),
    ({"topk_method": "greedy"}, "topk_method", "only 'noaux_tc' is supported"),
])
def test_contradicting_duplicate_keys_in_file(capsys, tmp_path, changes, key, msg):
    with open(resolve_config_path("kimi-linear-6p6b")) as f:
        lac = json.load(f)["linear_attn_config"]
    msg = msg.replace("= 32", f"= {lac['num_heads']}")
    bad = _linear_file(tmp_path, **changes)
    rc, out, err = run_cli(capsys, "inspect", bad, "--json")
    assert rc == 2 and out == ""
    assert one_line_error(err).startswith(f"k3ir: error: {bad}: key '{key}': {msg}"), err


def test_set_of_duplicate_keys_changes_the_model():
    from k3ir.accounting import report

    def count_params(m):
        return report(m).params_total
    base = {"num_hidden_layers": 8}
    via_lac = k3ir.load("kimi-linear-6p6b", overrides={**base, "linear_attn_config.num_heads": 4})
    via_flat = k3ir.load("kimi-linear-6p6b", overrides={**base, "linear_num_heads": 4})
    assert via_lac.config.kda_num_heads == via_flat.config.kda_num_heads == 4
    assert via_lac.config.raw["linear_num_heads"] == 4
    unchanged = k3ir.load("kimi-linear-6p6b", overrides=base)
    assert count_params(via_flat) == count_params(via_lac) < count_params(unchanged)
    nope = k3ir.load("kimi-linear-6p6b", overrides={**base, "qk_nope_head_dim": 64})
    assert nope.config.raw["qk_head_dim"] == 64 + nope.config.qk_rope_head_dim


@pytest.mark.parametrize("key", ["moe_layer_freq=2", "topk_method=greedy", "max_position_embeddings=8"])
def test_set_of_ignored_key_fails(capsys, key):
    rc, out, err = run_cli(capsys, "inspect", "k3-tiny", "--json", "--set", key)
    name = key.split("=")[0]
    assert rc == 2 and out == ""
    assert one_line_error(err) == f"k3ir: error: --set {key}: '{name}' is a key k3ir ignores (it would not change the model)"


def test_set_of_nested_key_named_like_an_ignored_one():
    """``head_dim`` is an ignored top-level HF key, but ``linear_attn_config.head_dim`` is read."""
    m = k3ir.load("kimi-linear-6p6b", overrides={"num_hidden_layers": 4, "linear_attn_config.head_dim": 64})
    assert m.config.kda_head_dim == 64
    with pytest.raises(k3ir.K3ConfigError, match="'head_dim' is a key k3ir ignores"):
        k3ir.load("kimi-linear-6p6b", overrides={"head_dim": 32})


def test_whole_linear_attn_config_override_carries_flat_keys():
    """bench/gpu_model_check.py's pattern: ``linear_attn_config`` overridden as one dict; the file's flat
    ``linear_num_heads`` / ``linear_head_dim`` follow it instead of contradicting it."""
    la = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 64, "num_heads": 2, "short_conv_kernel_size": 4}
    m = k3ir.load("kimi-linear-6p6b", {"num_hidden_layers": 4, "linear_attn_config": la,
                                       "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                       "mlp_layer_types": ["dense"] + ["sparse"] * 3})
    assert (m.config.kda_num_heads, m.config.kda_head_dim) == (2, 64)
    assert (m.config.raw["linear_num_heads"], m.config.raw["linear_head_dim"]) == (2, 64)
