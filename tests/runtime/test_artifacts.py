"""Compiled artifacts: ``k3ir compile MODEL --target tvm -o DIR`` then ``Session.load(DIR)``
reopens the TVM libraries without lowering or compiling, with the saved weights."""
from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import rel_err
from k3ir.runtime import Session

import k3ir

pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def tvm_artifact(tmp_path_factory, tvm_opt_level_0):
    m = k3ir.load("k3-tiny")
    exe = k3ir.compile(m, target="tvm")
    from k3ir.runtime.params import init_params
    params = init_params(exe.module, seed=5)
    d = tmp_path_factory.mktemp("tvm_art")
    exe.save(str(d), params)
    return str(d), m


def test_tvm_artifact_reloads_without_compiling(tvm_artifact, monkeypatch):
    d, m = tvm_artifact
    import k3ir.backends.tvm as tb
    from k3ir.backends.tvm import lower

    def no_build(*a, **k):
        raise AssertionError("Session.load must not lower or compile again")
    tb._COMPILED.clear()
    monkeypatch.setattr(lower, "build_relax", no_build)
    s = Session.load(d)
    ids = np.random.default_rng(0).integers(0, 256, (2, 17))
    want = Session(k3ir.compile(m, target="reference"), seed=5).forward(ids)
    assert rel_err(s.forward(ids), want) < 1e-4
    _, st = s.prefill(ids[:, :16])
    step, _ = s.decode(ids[:, 16:], st)
    assert rel_err(step[:, 0], want[:, 16]) < 1e-4


def test_load_rejects_a_non_artifact(tmp_path):
    with pytest.raises(k3ir.K3RuntimeError, match="not a compiled artifact"):
        Session.load(str(tmp_path))


def test_tvm_artifact_built_for_this_cpu_is_refused_where_an_extension_is_missing(tvm_artifact, tmp_path):
    """The manifest records this host's SIMD extensions; a copy claiming one this CPU lacks is refused by
    ``Session.load`` with one error naming it (instead of SIGILL in a kernel)."""
    import json
    import shutil

    from k3ir.backends.tvm import SIMD_FLAGS, host_simd_flags
    from k3ir.runtime import Session

    from k3ir.errors import K3RuntimeError
    d, _ = tvm_artifact
    have = host_simd_flags()
    if have is None:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    with open(os.path.join(d, "manifest.json")) as f:
        man = json.load(f)
    assert man["simd_flags"] == have
    lacking = [x for x in SIMD_FLAGS if x not in have]
    if not lacking:
        pytest.skip("this CPU has every listed extension")
    copy = shutil.copytree(d, tmp_path / "art")
    man["simd_flags"] = have + lacking[:1]
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(K3RuntimeError, match=rf"{lacking[0]}, which this CPU lacks; rebuild"):
        Session.load(str(copy))
