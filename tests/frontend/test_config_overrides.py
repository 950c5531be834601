"""Overrides that scale a bundled model down keep it consistent: ``num_hidden_layers`` on kimi-linear re-derives
``layer_types`` / ``mlp_layer_types`` / ``full_attn_layers`` (an explicit list stays as given), and a
``vocab_size`` override moves the special token ids with the end of the vocabulary."""
from __future__ import annotations

import json

import pytest
from conftest import run_cli

import k3ir


def test_vocab_override_moves_special_tokens():
    """Scaling kimi-k3 down (``vocab_size`` override alone) keeps the special tokens' distance from the end of the
    vocabulary (config: vocab 163840, bos 163584, eos 163586, pad 163839, media 163605) instead of failing the
    token id range check."""
    m = k3ir.load("kimi-k3", overrides={"vocab_size": 512, "num_hidden_layers": 2,
                                        "linear_attn_config.full_attn_layers": [2]})
    c = m.config
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.media_placeholder_token_id) == (256, 258, 511, 277)
    with pytest.raises(k3ir.K3ConfigError, match=r"key 'text_config.bos_token_id': must be in 0..511, got 600"):
        k3ir.load("kimi-k3", overrides={"vocab_size": 512, "bos_token_id": 600})
    small = k3ir.load("kimi-k3", overrides={"vocab_size": 100, "num_hidden_layers": 2,
                                            "linear_attn_config.full_attn_layers": [2]}).config
    assert (small.bos_token_id, small.pad_token_id) == (None, 99)


# ---- num_hidden_layers on kimi-linear re-derives layer_types / mlp_layer_types ------------------------------
@pytest.mark.parametrize("n, kda, mla, dense", [(2, 2, 0, 1), (4, 3, 1, 1), (5, 4, 1, 1), (1, 1, 0, 1)])
def test_kimi_linear_depth_override(capsys, n, kda, mla, dense):
    rc, out, err = run_cli(capsys, "inspect", "kimi-linear-6p6b", "--set", f"num_hidden_layers={n}", "--json")
    assert rc == 0, err
    counts = json.loads(out)["counts"]
    # the bundled file: full attention at 1-based layers 4, 8, 12, 16; layer 1 dense, the rest MoE
    assert counts == {"kda": kda, "mla": mla, "moe": n - dense, "dense": dense}


def test_kimi_linear_depth_override_lists():
    from k3ir.frontend.config import apply_overrides, read_config
    raw, _ = read_config("kimi-linear-6p6b")
    cfg = apply_overrides(raw, {"num_hidden_layers": 5})
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    assert cfg["mlp_layer_types"] == ["dense"] + ["sparse"] * 4
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4]
    kept = apply_overrides(raw, {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]})
    assert kept["layer_types"] == ["full_attention", "linear_attention"]       # an explicit list stays as given


def test_kimi_linear_readme_depth_command(capsys):
    rc, out, err = run_cli(capsys, "inspect", "kimi-linear-6p6b", "--set", "num_hidden_layers=2")
    assert rc == 0 and err == ""
    assert "layers: 2 KDA + 0 MLA" in out
