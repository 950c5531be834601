"""Random initialisation of parameters: a model too big for memory fails up front with its size (Python API and
CLI), and the seed must be an integer (numpy integers work; a different seed gives different weights)."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from k3ir.cli import main
from k3ir.runtime import Session, init_params

import k3ir
from k3ir.errors import K3RuntimeError


def test_random_init_too_big_for_memory_is_an_error(monkeypatch, tmp_path, capsys):
    """Random init of a model that cannot fit in memory fails up front with the size (the full Kimi K3 needs
    ~22.9 TB in float64), for the Python API and the CLI, instead of a NumPy MemoryError or a silent kill."""
    m = k3ir.load("k3-tiny")
    n = sum(int(d.type.numel()) for d in m.params.values())
    real = os.sysconf
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (8 * n) // 4096 // 2}     # half of what the init needs
    monkeypatch.setattr(os, "sysconf", lambda k: pages.get(k, None) if k in pages else real(k))
    with pytest.raises(K3RuntimeError, match="random init of .* needs .* GB"):
        init_params(m)
    monkeypatch.setattr(os, "sysconf", real)
    assert main(["train", "kimi-k3", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"random init of kimi-k3 needs [0-9]{2},[0-9]{3} GB", err) and "Traceback" not in err


def test_session_seed_must_be_an_integer():
    m = k3ir.load("k3-tiny", overrides={"num_hidden_layers": 2})
    exe = k3ir.compile(m, target="reference")
    for seed, what in (("x", "str 'x'"), (1.0, "float 1.0"), (True, "bool True")):
        with pytest.raises(K3RuntimeError, match=re.escape(f"seed must be an integer, got {what}")):
            Session(exe, seed=seed)
    params = init_params(m, 0)
    with pytest.raises(K3RuntimeError, match="seed must be an integer, got str 'x'"):
        Session(exe, params=params, seed="x")          # refused even where given weights leave it unused
    a, b = init_params(m, np.int64(3)), init_params(m, 3)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["language_model.model.embed_tokens.weight"],
                              init_params(m, 4)["language_model.model.embed_tokens.weight"])
