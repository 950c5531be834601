"""Backend plugins: the example out-of-tree package in tests/plugin_example is pip-installed
into a temporary directory and found through the ``k3ir.backends`` entry point: ``k3ir
backends`` lists it, ``k3ir check`` classifies ops for it and shows its own pipeline (a fusion
pass of the plugin producing an op the plugin declares), and a Session runs on it."""
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
    shutil.copytree(os.path.join(HERE, "..", "plugin_example"), src)      # keep build files out of the tree
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
    from k3ir.passes import PASSES

    from k3ir import backends, opdef  # the plugin's op, pass and target leave the registries
    opdef._OPS.pop(FUSED, None)
    PASSES.pop(PASS, None)
    backends._BACKENDS.pop("numpy-example", None)
    backends._ALIASES.pop("np-example", None)


#: the plugin's fused op and the pass producing it (tests/plugin_example/k3ir_plugin_example/fusion.py)
FUSED, PASS = "numpy_example.rmsnorm_linear", "numpy-example.fuse-rmsnorm-linear"


def norms_feeding_one_linear(m) -> int:
    """How many ``k3.rmsnorm`` results of ``m`` are read by exactly one op, a ``k3.linear``, and not returned."""
    n = 0
    for fn in m.functions.values():
        users = fn.users()
        returned = {id(v) for v in fn.returns}
        for op in fn.ops:
            if op.name == "k3.rmsnorm" and id(op.results[0]) not in returned:
                u = users.get(id(op.results[0]), [])
                n += len(u) == 1 and u[0].name == "k3.linear"
    return n


def _cli(args, plugin_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([plugin_dir, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "k3ir.cli", *args], capture_output=True, text=True, env=env,
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
    # the plugin's condition: lm_head is native up to 16384 columns; this model's 32000 decompose
    # (nn.py: cast(matmul(x, transpose(w)), f32))
    head = rows["k3.lm_head"]
    assert head["status"] == "conditional" and "32000 > 16384" in head["why"]
    assert head["via"] == {"k3.transpose": head["count"], "k3.matmul": head["count"], "k3.cast": head["count"]}
    for op in ("k3.kda", "k3.mla", "k3.moe", "k3.short_conv", "k3.router"):      # not in the plugin's table
        assert rows[op]["status"] == "decomposition", op
        assert set(rows[op]["via"]) <= {n for n, x in rows.items() if x["status"] == "native"} | set(rows[op]["via"])
    from k3ir.backends import get_backend
    native = get_backend("numpy-example").lowers()
    # the plugin's own pipeline: its fusion pass in phase fuse, then DCE
    rep = json.loads(r.stdout)
    assert rep["phases"] == [{"name": "fuse", "passes": [PASS]}, {"name": "cleanup", "passes": ["dce"]}]
    fused = norms_feeding_one_linear(k3ir.load("kimi-linear-6p6b"))      # none in Kimi Linear; k3-tiny: below
    assert rep["passes"][0] == {"phase": "fuse", "pass": PASS, "rewrites": fused}
    assert rows.get(FUSED, {"count": 0})["count"] == fused
    for row in rows.values():                          # every expansion ends in ops the plugin lowers
        assert row["status"] != "error"
        assert set(row["via"]) <= native, row["op"]
        assert (row["status"] in ("native", "conditional")) == (row["op"] in native)


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


def test_plugin_fusion_is_shown_by_check_and_ops(plugin_dir):
    """``k3ir check --target numpy-example`` lists the plugin's phases with the fusion's rewrites;
    ``k3ir ops`` finds the plugin's op in the plugin's file, native on the plugin, a decomposition elsewhere."""
    r = _cli(["check", "k3-tiny", "--target", "numpy-example"], plugin_dir)
    assert r.returncode == 0, r.stderr
    n = norms_feeding_one_linear(k3ir.load("k3-tiny"))
    assert f"phase fuse: {PASS} ({n} rewrites)" in r.stdout and FUSED in r.stdout
    r = _cli(["ops", FUSED, "--json"], plugin_dir)
    assert r.returncode == 0, r.stderr
    import json
    info = json.loads(r.stdout)
    path, line = info["defined"].rsplit(":", 1)
    assert path.endswith("k3ir_plugin_example/fusion.py") and info["family"] == "fused"
    with open(path) as f:
        assert f.read().splitlines()[int(line) - 1].startswith("@op(FUSED")
    by = {e["backend"]: e for e in info["backends"]}
    assert by["numpy-example"]["status"] == "native" and "fusion.py" in by["numpy-example"]["implementation"]
    assert by["torch"]["status"] == "decomposed" and by["reference"]["status"] == "native"


def test_plugin_fusion_keeps_the_logits(plugin_dir):
    """The fused op's float64 reference equals the unfused graph; its decomposition (torch, which lacks the op)
    and the plugin's native float32 kernel match it within SPEC.md 11 float32 tolerances."""
    from k3ir.passes import run_pipeline
    m = load_tiny("k3-tiny")
    params = init_params(m, seed=2)
    fused = run_pipeline(m.clone(), [("fuse", [PASS]), ("cleanup", ["dce"])], verify_each=True)
    assert len(list(fused.ops(FUSED))) == norms_feeding_one_linear(m) > 0
    assert not any(op.name == FUSED for op in m.ops())
    ids = token_ids(m.attrs["vocab_size"], 2, 7)
    want = Session(k3ir.compile(m, target="reference"), params=params).forward(ids).double().numpy()
    ref = Session(k3ir.compile(fused, target="reference"), params=params).forward(ids).double().numpy()
    assert rel_err(ref, want) < 1e-12
    dec = Session(k3ir.compile(fused, target="torch", passes=[]), params=params).forward(ids).double().numpy()
    assert rel_err(dec, want) < 1e-5
    exe = k3ir.compile(m, target="numpy-example")
    assert len(list(exe.module.ops(FUSED))) == len(list(fused.ops(FUSED)))     # the plugin's pipeline fused them
    nat = Session(exe, params=params).forward(ids).double().numpy()
    assert rel_err(nat, want) < 1e-4


@pytest.mark.parametrize("vocab,native", [(300, True), (17000, False)])
def test_plugin_condition_decides_what_runs(plugin_dir, monkeypatch, vocab, native):
    """The plugin's conditional ``k3.lm_head`` runs natively exactly when ``k3ir check`` says so (vocabulary
    <= 16384), else its decomposition; the logits match the float64 reference either way."""
    import k3ir_plugin_example as plug
    from k3ir.backends.check import check_module
    calls = []
    orig = plug.TABLE["k3.lm_head"]
    monkeypatch.setitem(plug.TABLE, "k3.lm_head", lambda inst, x, w: calls.append(1) or orig(inst, x, w))
    name, overrides = "kimi-linear-6p6b", dict(__import__("_tiny_models").KIMI_LINEAR_TINY, vocab_size=vocab)
    m = k3ir.load(name, overrides)
    status = {r.status for r in check_module(m, "numpy-example").rows if r.op == "k3.lm_head"}
    assert status == {"native" if native else "conditional"}
    params = init_params(m, seed=5)
    ids = token_ids(vocab, 1, 4)
    got = Session(k3ir.compile(m, target="numpy-example"), params=params).forward(ids)
    want = Session(k3ir.compile(m, target="reference", dtype="float64"), params=params).forward(ids)
    assert bool(calls) == native
    assert rel_err(np.asarray(got), np.asarray(want)) < 1e-4


def test_a_backend_declaring_only_lowers_still_works(monkeypatch):
    """The older plugin form ``Backend(..., lowers=lambda: set(TABLE))`` (a plain dict, no conditions):
    its ops are native, the rest decompose, and ``check_module`` classifies them. Registered for this test only."""
    from k3ir.backends import Backend, register_backend

    from k3ir import backends
    backends.list_backends()
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    from k3ir.backends.check import check_module
    from k3ir.backends.reference import ReferenceExecutable
    core = {n for n, c in k3ir.opdef.all_ops().items() if c.family == "core"}
    be = register_backend(Backend(name="test-lowers-only", description="test", pipeline=[], lowers=lambda: core,
                                  build=lambda module, dtype="float64", device="cpu": ReferenceExecutable(module, dtype,
                                                                                                          device)))
    m = load_tiny("k3-tiny")
    ops = {op.name: op for op in m.functions["forward"].ops}
    assert [be.supports(op) for name, op in ops.items() if name in core] == [None] * len(core & set(ops)) != []
    assert "no lowering for k3.rmsnorm" in be.supports(ops["k3.rmsnorm"])
    assert set(be.lowering_table()) == core
    rep = check_module(m, "test-lowers-only", requested=["forward"])
    status = {r.op: r.status for r in rep.rows}
    assert status["k3.rmsnorm"] == "decomposition" and not rep.failed
    assert all(s in ("native", "decomposition") for s in status.values())
