"""Kimi-family checkpoint formats that k3ir does not build yet are refused with a message naming the formats
it reads (docs/checkpoints.md), not half-read as Kimi Linear."""
import json

import pytest
from conftest import one_line_error, run_cli

import k3ir
from k3ir.errors import K3ConfigError


@pytest.mark.parametrize("model_type", ["kimi_k2", "deepseek_v3", "kimi_k25"])
def test_unserved_family_config_is_refused_naming_the_supported_formats(tmp_path, model_type):
    cfg = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
           "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(K3ConfigError) as err:
        k3ir.load(str(path))
    msg = str(err.value)
    assert model_type in msg and "kimi_k3" in msg and "kimi_linear" in msg and "config.json" in msg
    assert "not supported yet" in msg and "RoPE MLA" in msg and "docs/checkpoints.md" in msg


def test_kimi_k25_wrapper_with_a_deepseek_text_config_is_refused(tmp_path):
    cfg = {"model_type": "kimi_k3", "text_config": {"model_type": "deepseek_v3", "hidden_size": 64}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(K3ConfigError, match="text_config.model_type"):
        k3ir.load(str(path))


def test_cli_refuses_an_unserved_family_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 64}))
    rc, _, err = run_cli(capsys, "inspect", str(path))
    assert rc == 2 and "kimi_k2" in one_line_error(err)
