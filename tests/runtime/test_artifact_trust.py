"""An artifact's manifest is data: ``Session.load`` reopens it through the registered target's backend and
never imports or calls anything the manifest names; another artifact format version is refused with the
advice to re-compile (docs/artifacts.md)."""
from __future__ import annotations

import json
import os
import runpy
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3ir.backends import Backend
from k3ir.backends.artifact import FORMAT_VERSION
from k3ir.runtime import Session, init_params

import k3ir
from k3ir.errors import K3BackendError, K3Error, K3RuntimeError


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory):
    """(artifact directory of k3-tiny on the torch target, the Session it was saved from)."""
    exe = k3ir.compile(k3ir.load("k3-tiny", overrides={"hidden_size": 32}), target="torch")
    params = init_params(exe.module, seed=3)
    d = tmp_path_factory.mktemp("trust") / "art"
    exe.save(str(d), params)
    return d, Session(exe, params=params)


def _copy(src, dst, **changes):
    """A copy of artifact ``src`` at ``dst`` with manifest entries replaced (None deletes one)."""
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    for k, v in changes.items():
        if v is None:
            man.pop(k, None)
        else:
            man[k] = v
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_saved_manifest_names_a_target_and_no_code(torch_artifact):
    d, saved = torch_artifact
    man = json.loads((d / "manifest.json").read_text())
    assert man["target"] == "torch" and man["format_version"] == FORMAT_VERSION and "loader" not in man
    ids = np.random.default_rng(0).integers(0, 256, (2, 7))
    assert torch.equal(Session.load(str(d)).forward(ids), saved.forward(ids))


@pytest.mark.parametrize("changes", [
    {"loader": "runpy:run_path"},                                  # this format plus a callable
    {"loader": "runpy:run_path", "format_version": None},          # the format that named a loader
    {"loader": "os:system"},
    {"target": "runpy:run_path"},                                  # a callable where the target belongs
])
def test_manifest_naming_code_is_refused_and_runs_nothing(torch_artifact, tmp_path, changes):
    """The payload ``__main__.py`` writes a marker file when run (``runpy.run_path(DIR)`` runs it, as the
    check at the end shows); Session.load refuses the manifest and the marker never appears."""
    d = _copy(torch_artifact[0], tmp_path / "art", **changes)
    marker = tmp_path / "marker"
    (d / "__main__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(str(d))
    msg = str(ei.value)
    assert msg.startswith(os.path.join(str(d), "manifest.json") + ": "), msg
    if "target" in changes:
        assert "unknown target 'runpy:run_path'" in msg, msg
    elif "format_version" in changes:
        assert "format version 1 (written by an older k3ir)" in msg and "`k3ir compile" in msg, msg
    else:
        assert f"key 'loader' ('{changes['loader']}') names code to run" in msg, msg
    assert not marker.exists()
    runpy.run_path(str(d))                  # the payload is live: running it does write the marker
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("version, words", [
    (1, "format version 1 (written by an older k3ir); this k3ir reads only version 2"),
    (FORMAT_VERSION + 1, f"format version {FORMAT_VERSION + 1} (written by a newer k3ir)"),
    ("2", "key 'format_version' must be an integer, got '2'"),
    (True, "key 'format_version' must be an integer, got True"),
])
def test_other_format_version_refused(torch_artifact, tmp_path, version, words):
    d = _copy(torch_artifact[0], tmp_path / "art", format_version=version)
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(str(d))
    assert words in str(ei.value), str(ei.value)
    if isinstance(version, int) and not isinstance(version, bool):
        assert str(ei.value).endswith("compile the model again with `k3ir compile MODEL --target torch -o DIR`")


@pytest.mark.parametrize("changes, words", [
    ({"sizes": {"../weights.safetensors": 1}}, "key 'sizes' names '../weights.safetensors', a path outside"),
    ({"sizes": {"/etc/hostname": 1}}, "key 'sizes' names '/etc/hostname', a path outside"),
    ({"module": "/etc/hostname"}, "key 'module' must name the IR file inside the artifact directory"),
    ({"files": {"weights": "other.safetensors"}}, "key 'files.weights' must name a file listed in 'sizes'"),
    ({"dtype": "float8"}, "unknown dtype 'float8' for target 'torch'"),
    ({"target": 7}, "key 'target' must be a target name (string), got 7"),
    ({"format": "pickle"}, "not a k3ir artifact manifest (key 'format' is 'pickle'"),
    ({"device": "tpu"}, "key 'device': unknown device 'tpu' (want cpu, cuda or cuda:N)"),
])
def test_manifest_entries_checked(torch_artifact, tmp_path, changes, words):
    d = _copy(torch_artifact[0], tmp_path / "art", **changes)
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(str(d))
    assert words in str(ei.value), str(ei.value)
    assert str(ei.value).startswith(os.path.join(str(d), "manifest.json") + ": "), str(ei.value)


def test_manifest_that_is_not_an_object(torch_artifact, tmp_path):
    d = _copy(torch_artifact[0], tmp_path / "art")
    (d / "manifest.json").write_text('["runpy:run_path"]')
    with pytest.raises(K3RuntimeError, match=r"not a k3ir artifact manifest \(key 'format' is 'list'"):
        Session.load(str(d))


def _register(monkeypatch, backend: Backend) -> None:
    import k3ir.backends as b
    b._load()
    monkeypatch.setitem(b._BACKENDS, backend.name, backend)


def test_registered_backend_supplies_the_loading_function(torch_artifact, tmp_path, monkeypatch):
    """A target's ``Backend.load_artifact`` gets the directory, the checked manifest and the parsed IR."""
    torch_backend = k3ir.backends.get_backend("torch")
    calls = []

    def load(directory, man, module):
        calls.append((directory, man["target"], module.name))
        return torch_backend.build(module, dtype=man["dtype"], device="cpu")
    _register(monkeypatch, Backend(name="trust-example", description="test target", build=torch_backend.build,
                                   load_artifact=load))
    d = _copy(torch_artifact[0], tmp_path / "art", target="trust-example")
    s = Session.load(str(d), params=torch_artifact[1].params)
    assert calls == [(str(d), "trust-example", torch_artifact[1].module.name)]
    ids = np.random.default_rng(1).integers(0, 256, (1, 5))
    assert torch.equal(s.forward(ids), torch_artifact[1].forward(ids))


def test_target_that_cannot_run_here(torch_artifact, tmp_path, monkeypatch):
    torch_backend = k3ir.backends.get_backend("torch")
    _register(monkeypatch, Backend(name="trust-absent", description="test target", build=torch_backend.build,
                                   available=lambda: "trust-absent-lib is not installed"))
    d = _copy(torch_artifact[0], tmp_path / "art", target="trust-absent")
    with pytest.raises(K3BackendError, match=r"a 'trust-absent' artifact, and target 'trust-absent' cannot run here: "
                                             r"trust-absent-lib is not installed"):
        Session.load(str(d))


def test_errors_are_k3errors(torch_artifact, tmp_path):
    """Each manifest problem above is a K3Error (the CLI's one-line exit 2), never another exception."""
    d = _copy(torch_artifact[0], tmp_path / "art", files={"weights": 5})
    with pytest.raises(K3Error, match="key 'files' must map names to strings"):
        Session.load(str(d))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.sampled_from(["runpy:run_path", "os:system", "torch", "tvm", "../weights.safetensors", "/etc/hostname",
                       "__main__.py", "float64", "cuda:7"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["format", "format_version", "target", "dtype", "device", "files", "sizes", "module",
                            "loader", "extra"]), value=json_values, drop=st.booleans())
def test_fuzzed_manifest_runs_nothing_and_fails_with_k3errors(torch_artifact, key, value, drop):
    """Any manifest entry replaced or deleted: Session.load opens the artifact or raises a K3Error, and the
    payload beside it never runs."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        d = _copy(torch_artifact[0], Path(tmp) / "art")
        marker = Path(tmp) / "marker"
        (d / "__main__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        man = json.loads((d / "manifest.json").read_text())
        if drop:
            man.pop(key, None)
        else:
            man[key] = value
        (d / "manifest.json").write_text(json.dumps(man))
        try:
            Session.load(str(d))
        except K3Error as e:
            assert "\n" not in str(e), str(e)
        assert not marker.exists()
