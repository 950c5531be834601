""""Did you mean" for misspelt names: bundled model names (not for far names or paths), targets, ``--set`` keys;
``--target cuda`` says cuda is a device."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli, usage_error

import k3ir
from k3ir.errors import K3BackendError, K3ConfigError


@pytest.mark.parametrize("name,near", [("kimi-k2", "kimi-k3"), ("k3tiny", "k3-tiny"), ("K3-Tiny", "k3-tiny"),
                                       ("kimi-linear", "kimi-linear-6p6b")])
def test_misspelt_model_suggests_a_bundled_name(capsys, name, near):
    with pytest.raises(K3ConfigError, match=f"did you mean '{near}'"):
        k3ir.load(name)
    rc, _, err = run_cli(capsys, "inspect", name)
    assert rc == 2 and f"did you mean '{near}'?" in one_line_error(err)


@pytest.mark.parametrize("name", ["zzz", "./kimi-k2", "models/k3tiny"])
def test_no_suggestion_for_far_names_or_paths(name):
    with pytest.raises(K3ConfigError) as e:
        k3ir.load(name)
    assert "did you mean" not in str(e.value) and "no such file" in str(e.value)


def test_misspelt_target_and_set_key_suggest(capsys):
    with pytest.raises(K3BackendError, match="did you mean 'torch'"):
        k3ir.compile(k3ir.load("k3-tiny"), target="torh")
    line = usage_error(capsys, "compile", "k3-tiny", "--target", "tritn", "--no-build")
    assert "argument --target: unknown target 'tritn'" in line and "did you mean 'triton'?" in line
    line = usage_error(capsys, "compile", "k3-tiny", "--target", "cuda", "--no-build")
    assert "'cuda' is a device, not a target" in line
    rc, _, err = run_cli(capsys, "inspect", "k3-tiny", "--set", "hidden_sizee=3")
    assert rc == 2 and "did you mean 'hidden_size'?" in one_line_error(err)
