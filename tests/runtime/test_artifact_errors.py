"""Opening a compiled artifact (``Session.load``) that is missing, not a directory, damaged or written by an older
k3ir: a K3RuntimeError naming the file at fault, before any library is loaded (the manifest records each file's
size, so a truncated shared library never reaches dlopen)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import run_cli
from k3ir.cli import main
from k3ir.runtime import Session

import k3ir
from k3ir.errors import K3RuntimeError


def test_loading_a_missing_artifact_directory_says_so(tmp_path):
    with pytest.raises(K3RuntimeError, match="no such directory"):
        Session.load(str(tmp_path / "missing"))
    with pytest.raises(K3RuntimeError, match="not a compiled artifact"):
        Session.load(str(tmp_path))


def test_session_load_of_a_file(tmp_path):
    f = tmp_path / "file.py"
    f.write_text("x = 1\n")
    with pytest.raises(K3RuntimeError, match=r"file.py: is a file, not a compiled artifact directory"):
        Session.load(str(f))


def test_truncated_shared_library_refused_before_dlopen(tmp_path):
    """A TVM artifact whose .so was truncated: the manifest's recorded size stops Session.load before
    tvm.runtime.load_module (which would SIGBUS). The library here is a stand-in file: the check runs first."""
    pytest.importorskip("tvm")
    from k3ir.backends.artifact import write_manifest
    d = tmp_path / "art"
    d.mkdir()
    (d / "tvm_forward.so").write_bytes(b"\x7fELF" + bytes(20000))
    (d / "weights.safetensors").write_bytes(bytes(64))
    write_manifest(str(d), k3ir.load("k3-tiny"), "tvm", "float32",
                   {"forward": "tvm_forward.so", "names:forward": json.dumps(["forward"]),
                    "weights": "weights.safetensors"})
    man = json.loads((d / "manifest.json").read_text())
    assert man["sizes"] == {"module.k3": os.path.getsize(d / "module.k3"), "tvm_forward.so": 20004,
                            "weights.safetensors": 64}
    os.truncate(d / "tvm_forward.so", 5000)
    with pytest.raises(K3RuntimeError, match=r"tvm_forward.so: 5000 bytes, the manifest records 20004 \(truncated "
                                             r"or replaced\); the artifact is damaged; write it again"):
        Session.load(str(d))
    os.remove(d / "tvm_forward.so")
    with pytest.raises(K3RuntimeError, match=r"tvm_forward.so: missing from the artifact"):
        Session.load(str(d))


def test_ir_artifact_sizes_and_old_manifest(capsys, tmp_path):
    d = tmp_path / "art"
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "-o", str(d))
    assert rc == 0, err
    ref = Session.load(str(d)).forward([[1, 2, 3]])
    man = json.loads((d / "manifest.json").read_text())
    assert man["sizes"]["weights.safetensors"] == os.path.getsize(d / "weights.safetensors")
    old = {k: v for k, v in man.items() if k not in ("sizes", "format_version")}   # written before sizes: refused
    (d / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(K3RuntimeError, match=r"artifact format version 1 \(written by an older k3ir\).*`k3ir compile"):
        Session.load(str(d))
    (d / "manifest.json").write_text(json.dumps(man))
    assert (Session.load(str(d)).forward([[1, 2, 3]]) == ref).all()
    man["sizes"] = {"weights.safetensors": os.path.getsize(d / "weights.safetensors") + 1}
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(K3RuntimeError, match=r"weights.safetensors: \d+ bytes, the manifest records \d+"):
        Session.load(str(d))


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    assert main(["compile", "k3-tiny", "--target", "torch", "-o", str(out)]) == 0
    return out


def _damaged(src, dst, damage):
    shutil.copytree(src, dst)
    damage(dst)
    return str(dst)


def test_damaged_artifact_raises_k3error(torch_artifact, tmp_path):
    assert Session.load(str(torch_artifact)).vocab > 0          # the intact one opens
    bad1 = _damaged(torch_artifact, tmp_path / "bad1", lambda d: (d / "manifest.json").write_text("{\n"))
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad1)
    assert str(ei.value).startswith(os.path.join(bad1, "manifest.json") + ": invalid JSON at line 2, column 1")
    assert "damaged" in str(ei.value)

    bad2 = _damaged(torch_artifact, tmp_path / "bad2", lambda d: (d / "weights.safetensors").unlink())
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad2)
    assert str(ei.value).startswith(os.path.join(bad2, "weights.safetensors") + ": missing from the artifact")

    bad3 = _damaged(torch_artifact, tmp_path / "bad3", lambda d: (d / "weights.safetensors").write_bytes(b"\x08"))
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad3)
    assert str(ei.value).startswith(os.path.join(bad3, "weights.safetensors") + ": 1 bytes, the manifest records ")
    assert "damaged" in str(ei.value)                           # the recorded size catches it before the reader


def test_artifact_files_take_the_umask_mode(tmp_path):
    """Every file of an artifact is readable as the umask allows (safetensors writes its weights 0600, so a copied
    or served artifact could not be read by another user)."""
    import os
    import stat

    from k3ir.runtime.params import init_params

    import k3ir
    m = k3ir.load("k3-tiny")
    exe = k3ir.compile(m, target="reference")
    exe.save(str(tmp_path / "art"), init_params(m))
    want = os.stat(tmp_path / "art" / "manifest.json").st_mode & 0o777
    assert want & stat.S_IRGRP or os.umask(os.umask(0)) & stat.S_IRGRP
    for f in os.listdir(tmp_path / "art"):
        assert os.stat(tmp_path / "art" / f).st_mode & want == want, f
