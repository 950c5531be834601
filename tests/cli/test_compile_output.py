"""What ``k3ir compile -o DIR`` leaves in DIR (cli/output_dir.py, docs/cli.md): a refused flag writes nothing; an
earlier k3ir output is replaced whole; a directory of other files is refused untouched; a failed write leaves the
earlier artifact."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli


@pytest.mark.parametrize(("flags", "words"), [
    (("--target", "torch"), "--emit-source: target 'torch' writes no device source (the tvm-<kind> GPU targets do)"),
    (("--target", "tvm", "--ir-only"), "--emit-source: target 'tvm' writes no device source"),
    (("--target", "tvm-cuda", "--ir-only"), "not with --ir-only/--no-build"),
])
def test_refused_emit_source_writes_nothing(capsys, tmp_path, flags, words):
    """``--emit-source`` with a target that has no device source (or without a build) is refused before the model
    is read: exit 2, one line, nothing on stdout, and no ``module.k3`` in the output directory (it was written
    there before the error)."""
    out = tmp_path / "art"
    rc, stdout, err = run_cli(capsys, "compile", "k3-tiny", *flags, "-o", str(out), "--emit-source")
    assert rc == 2 and stdout == "" and words in one_line_error(err), err
    assert not out.exists()
    out.mkdir()
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", *flags, "-o", str(out), "--emit-source")
    assert rc == 2 and list(out.iterdir()) == []


def test_emit_source_without_output_is_refused(capsys):
    rc, stdout, err = run_cli(capsys, "compile", "k3-tiny", "--target", "tvm-cuda", "--emit-source")
    assert rc == 2 and stdout == ""
    assert one_line_error(err) == "k3ir: error: --emit-source writes the device source into the artifact: give -o DIR"


def _compile(capsys, out, *flags) -> tuple[int, str, str]:
    return run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "-o", str(out), *flags)


def _staging_left(parent) -> list[str]:
    return [p.name for p in parent.iterdir() if ".k3ir-" in p.name]


def test_recompiling_replaces_the_output_wholly(capsys, tmp_path):
    """A compile into an earlier output leaves exactly what a compile into a new directory leaves: the files of the
    earlier build (its weights, its manifest, a stray library, a folder) are gone, whatever either build was."""
    from k3ir.runtime import Session
    fresh, out = tmp_path / "fresh", tmp_path / "art"
    assert _compile(capsys, fresh)[0] == 0
    assert _compile(capsys, out)[0] == 0
    (out / "tvm_llvm_old.so").write_bytes(b"\x7fELF")
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_bytes(b"x")
    rc, stdout, err = _compile(capsys, out, "--ir-only")
    assert rc == 0 and err == "" and f"wrote {out / 'module.k3'} and passes.json" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["module.k3", "passes.json"]    # no weights, no manifest left
    rc, stdout, err = _compile(capsys, out)
    assert rc == 0 and err == "" and f"artifact to {out}" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert (out / "manifest.json").read_text() == (fresh / "manifest.json").read_text()
    logits = Session.load(str(out)).forward([[1, 2, 3]])
    assert logits.shape[-2] == 3 and (logits == Session.load(str(fresh)).forward([[1, 2, 3]])).all()
    assert _staging_left(tmp_path) == []


def test_an_empty_directory_and_a_link_to_an_artifact_are_written(capsys, tmp_path):
    """An empty directory takes the output; ``-o`` a symbolic link to an artifact: the directory it points to is
    replaced and the link stays a link."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _compile(capsys, empty, "--ir-only")[0] == 0
    assert sorted(p.name for p in empty.iterdir()) == ["module.k3", "passes.json"]
    link = tmp_path / "link"
    link.symlink_to(empty)
    assert _compile(capsys, link)[0] == 0
    assert link.is_symlink() and (empty / "manifest.json").is_file() and (empty / "weights.safetensors").is_file()
    assert _staging_left(tmp_path) == []


@pytest.mark.parametrize("kind", ["files", "file"])
def test_other_output_paths_are_refused_untouched(capsys, tmp_path, kind):
    """A non-empty directory that no k3ir compile wrote (no manifest.json of format k3ir-artifact, no passes.json
    of --ir-only), or a file: exit 2 before the model is read, one line naming the path, nothing changed there."""
    out = tmp_path / "mine"
    if kind == "files":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
        (out / "manifest.json").write_text('{"format": "something-else"}')
        words = f"-o {out}: not empty and not a k3ir artifact directory"
    else:
        out.write_text("keep me")
        words = f"-o {out}: exists and is not a directory"
    rc, stdout, err = _compile(capsys, out)
    assert rc == 2 and stdout == "" and one_line_error(err).startswith(f"k3ir: error: {words}"), err
    if kind == "files":
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt"]
        assert (out / "notes.txt").read_text() == "keep me"
    else:
        assert out.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_earlier_artifact(capsys, tmp_path, monkeypatch, failure):
    """The artifact is written beside ``-o`` and moved in at the end: when writing it fails after its files are
    out (a full disk, Ctrl-C) the earlier artifact is there as it was, and no staging directory is left."""
    from k3ir.backends import get_backend
    out = tmp_path / "art"
    assert _compile(capsys, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    backend = get_backend("torch")
    build = backend.build

    def failing_build(*args, **kwargs):
        exe = build(*args, **kwargs)
        save = exe.save

        def save_then_fail(directory, params):
            save(directory, params)
            raise failure
        exe.save = save_then_fail
        return exe
    monkeypatch.setattr(backend, "build", failing_build)
    rc, _, err = _compile(capsys, out, "--seed", "7")
    assert rc == (130 if isinstance(failure, KeyboardInterrupt) else 2), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _staging_left(tmp_path) == []


def test_the_current_directory_is_refused(capsys, tmp_path, monkeypatch):
    """The output replaces ``-o`` whole: the current directory (empty here) is refused, not moved away from under
    the shell that ran the compile."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    rc, stdout, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--ir-only", "-o", ".")
    assert rc == 2 and stdout == "" and one_line_error(err).startswith("k3ir: error: -o .: is the current directory")
    assert list(here.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_ir_dumps_inside_the_output_are_refused(capsys, tmp_path):
    """``--dump-ir`` inside ``-o``: the output replacing ``-o`` whole would delete the dumps (or find them and
    refuse the directory at the end): refused first, nothing created."""
    out = tmp_path / "art"
    rc, stdout, err = _compile(capsys, out, "--dump-ir", str(out / "ir"))
    assert rc == 2 and stdout == "" and f"--dump-ir {out / 'ir'}: inside -o {out}" in one_line_error(err)
    assert list(tmp_path.iterdir()) == []
    rc, _, err = _compile(capsys, out, "--ir-only", "--dump-ir", str(tmp_path / "ir"))
    assert rc == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["art", "ir"]
