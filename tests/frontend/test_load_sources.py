"""What ``k3ir.load`` takes besides a config or a checkpoint: a ``.k3`` text IR file (str or Path; verified on
load; overrides refused since it has no config); a training run's ``checkpoints/latest`` pointer passed as MODEL
is an error naming the checkpoint directory to pass."""
from __future__ import annotations

import re

import pytest
from conftest import one_line_error, run_cli
from helpers import replace_first, tiny_k3_text

import k3ir
from k3ir.errors import K3ConfigError, K3VerifyError


def test_load_parses_k3_file(tmp_path):
    tiny_text = tiny_k3_text()
    p = tmp_path / "tiny.k3"
    p.write_text(tiny_text)
    m = k3ir.load(str(p))
    assert k3ir.print_module(m) == tiny_text
    assert k3ir.load(p).attrs["vocab_size"] == 260                    # a Path works too
    with pytest.raises(K3ConfigError, match=r"tiny.k3: overrides set config keys; a .k3 IR file has no config"):
        k3ir.load(str(p), overrides={"hidden_size": 96})
    bad, line, col = replace_first(tiny_text, "{eps=1e-05", "{eps=-5.0")
    p.write_text(bad)
    with pytest.raises(K3VerifyError, match=rf"^{re.escape(str(p))}:{line}:{col}: .*eps must be > 0, got -5.0$"):
        k3ir.load(str(p))


def test_checkpoint_pointer_as_model(capsys, tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    (ck / "step-000080").mkdir(parents=True)
    (ck / "latest").write_text("step-000080\n")            # what train_checkpoint.save_checkpoint writes
    rc, _, err = run_cli(capsys, "generate", str(ck / "latest"), "--prompt", "The ", "--max-tokens", "4")
    assert rc == 2, err
    line = one_line_error(err)
    assert f"{ck / 'latest'}: is a training run's checkpoint pointer (it names step-000080)" in line, line
    assert f"pass the checkpoint directory {ck / 'step-000080'}" in line and "invalid JSON" not in line, line
    other = tmp_path / "latest"                              # a stray file called latest: still plain JSON error
    other.write_text("not json\n")
    with pytest.raises(K3ConfigError, match="invalid JSON at line 1"):
        k3ir.load(str(other))
