"""What ``k3ir.load`` takes besides a config or a checkpoint: a ``.k3`` text IR file (str or Path; verified on
load; overrides refused since it has no config)."""
from __future__ import annotations

import re

import pytest
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
