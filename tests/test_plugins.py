"""Backend plugins: the example out-of-tree package in tests/plugin_example is pip-installed
into a temporary directory and found through the ``k3ir.backends`` entry point: ``k3ir
backends`` lists it, ``k3ir check`` classifies ops for it, and a Session runs on it."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from _tiny_models import load_tiny, prefill_decode, token_ids
from conftest import rel_err
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """pip-install the example plugin (no deps, no build isolation: offline) into a temp target
    directory, put it on sys.path and re-scan the entry points."""
    base = tmp_path_factory.mktemp("plugin")
    src = base / "src"
    shutil.copytree(os.path.join(HERE, "plugin_example"), src)      # keep build files out of the tree
    target = base / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    from k3ir.backends import list_backends, load_plugins
    list_backends()                      # built-ins first
    assert "numpy-example" in load_plugins()
    yield str(target)
    sys.path.remove(str(target))


def _cli(args, plugin_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin_dir, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "k3ir.runtime.cli", *args], capture_output=True, text=True, env=env,
                          check=False)


def test_plugin_is_listed_by_k3ir_backends(plugin_dir):
    r = _cli(["backends"], plugin_dir)
    assert r.returncode == 0, r.stderr
    assert "numpy-example" in r.stdout and "example plugin" in r.stdout


def test_check_lists_native_and_decomposed_ops_for_the_plugin(plugin_dir):
    r = _cli(["check", "kimi-linear-6p6b", "--target", "numpy-example", "--json"], plugin_dir)
    assert r.returncode == 0, r.stderr
    import json
    rows = {row["op"]: row for row in json.loads(r.stdout)["ops"]}
    assert rows["k3.linear"]["status"] == "native" and rows["k3.rmsnorm"]["status"] == "native"
    for op in ("k3.kda", "k3.mla", "k3.moe", "k3.short_conv", "k3.router"):      # not in the plugin's table
        assert rows[op]["status"] == "decomposition", op
        assert set(rows[op]["via"]) <= {n for n, x in rows.items() if x["status"] == "native"} | set(rows[op]["via"])
    from k3ir.backends import get_backend
    native = get_backend("numpy-example").lowers()
    for row in rows.values():                          # every expansion ends in ops the plugin lowers
        assert row["status"] != "error"
        assert set(row["via"]) <= native, row["op"]


def test_session_runs_on_the_plugin(plugin_dir):
    m = load_tiny("kimi-linear-tiny")
    params = init_params(m, seed=5)
    exe = k3ir.compile(m, target="np-example")                         # by alias
    assert exe.target == "numpy-example"
    ref = Session(k3ir.compile(m, target="reference", dtype="float64"), params=params)
    ids, nxt = token_ids(m.attrs["vocab_size"], 2, 9), token_ids(m.attrs["vocab_size"], 2, 1, seed=7)
    got = prefill_decode(Session(exe, params=params), ids, nxt)
    want = prefill_decode(ref, ids, nxt)
    assert rel_err(got[0], want[0]) < 1e-4 and rel_err(got[1], want[1]) < 1e-4
    assert np.isfinite(got[1]).all()
