"""Bad values in a config.json or a ``--set``: the error names the file and the dotted key and says what was
expected (dtype names, finite positive epsilons, special token ids inside the vocabulary), as a K3ConfigError
and as one CLI line at exit 2."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli, tiny_config_file
from k3ir.frontend.config import load_config

import k3ir
from k3ir.errors import K3ConfigError


def test_bad_torch_dtype_is_rejected_even_next_to_dtype():
    """``torch_dtype`` (the older key) is validated even when ``dtype`` is present and wins
    (--set torch_dtype=float33 is refused); "auto" means the file's dtype."""
    with pytest.raises(K3ConfigError, match="torch_dtype.*float33"):
        load_config("k3-tiny", {"torch_dtype": "float33"})
    assert load_config("k3-tiny", {"torch_dtype": "auto"}).dtype == load_config("k3-tiny").dtype
    assert load_config("kimi-linear-6p6b", {"torch_dtype": "float32"}).dtype == "bf16"   # "dtype" wins


# ---- epsilons: finite and > 0 ----------------------------------------------------------------------------------
def test_negative_eps_names_the_real_bound(capsys):
    rc, out, err = run_cli(capsys, "inspect", "k3-tiny", "--set", "rms_norm_eps=-1")
    assert rc == 2 and out == ""
    assert one_line_error(err).endswith("key 'text_config.rms_norm_eps': must be > 0, got -1.0"), err


def test_vision_eps_checked_at_load(capsys, tmp_path):
    for value, what in ((float("nan"), "must be finite, got nan"), (float("inf"), "must be finite, got inf"),
                        (0.0, "must be > 0, got 0.0"), (-1e-6, "must be > 0, got -1e-06"), ("x", "must be float")):
        path = tiny_config_file(tmp_path, "vision_config", "projector_ln_eps", value)
        rc, _, err = run_cli(capsys, "inspect", path)
        assert rc == 2, (value, err)
        line = one_line_error(err)
        assert f"{path}: key 'vision_config.projector_ln_eps': {what}" in line, line
    m = k3ir.load(tiny_config_file(tmp_path, "vision_config", "projector_ln_eps", 3e-5))
    eps = [op.attrs["eps"] for op in m.functions["encode_images"].ops if op.name == "k3.layernorm"]
    assert eps[-1] == 3e-5 and eps.count(3e-5) == 1         # the projector's pre-norm, the last layernorm


def test_config_rejects_nan_eps_at_load(capsys, tmp_path):
    for value, what in ((float("nan"), "must be finite, got nan"), (float("inf"), "must be finite, got inf"),
                        (0.0, "must be > 0, got 0.0"), (-1e-6, "must be > 0, got -1e-06")):
        path = tiny_config_file(tmp_path, "text_config", "rms_norm_eps", value)
        rc, _, err = run_cli(capsys, "inspect", path)
        assert rc == 2, (value, err)
        line = one_line_error(err)
        assert "c_bad.json" in line and "'text_config.rms_norm_eps'" in line and what in line, line
    path = tiny_config_file(tmp_path, "text_config", "activation_situ_beta", float("-inf"))
    with pytest.raises(K3ConfigError, match="activation_situ_beta.*must be finite"):
        k3ir.frontend.load_config(path)
    path = tiny_config_file(tmp_path, "text_config", "rms_norm_eps", 1e-5)   # a finite positive eps still loads
    assert k3ir.frontend.load_config(path).rms_norm_eps == 1e-5


# ---- special token ids are range-checked at load ------------------------------------------------------------
@pytest.mark.parametrize("section,key,value,msg", [
    ("text_config", "bos_token_id", -1, "must be in 0..259, got -1"),
    ("text_config", "bos_token_id", 5000, "must be in 0..259, got 5000"),
    ("text_config", "eos_token_id", 999, "must be in 0..259, got 999"),
    ("text_config", "eos_token_id", [257, 260], "must be in 0..259, got 260"),
    ("text_config", "pad_token_id", 9999, "must be in 0..259, got 9999"),
    ("text_config", "pad_token_id", "x", "must be an int token id, got str 'x'"),
    ("", "media_placeholder_token_id", 5000, "must be in 0..259, got 5000"),
    ("", "eos_token_id", 260, "must be in 0..259, got 260"),
])
def test_special_token_ids_range_checked(capsys, tmp_path, section, key, value, msg):
    bad = tiny_config_file(tmp_path, section, key, value)
    rc, out, err = run_cli(capsys, "inspect", bad, "--json")
    assert rc == 2 and out == ""
    dotted = f"{section}.{key}" if section else key
    assert one_line_error(err) == f"k3ir: error: {bad}: key '{dotted}': {msg}"


def test_special_token_ids_valid_edges(tmp_path):
    cfg = k3ir.load(tiny_config_file(tmp_path, "text_config", "eos_token_id", [0, 259])).config
    assert cfg.eos_token_id == [0, 259]
    assert k3ir.load(tiny_config_file(tmp_path, "text_config", "bos_token_id", None)).config.bos_token_id is None
