"""What ``k3ir compile -o DIR`` leaves in DIR: a refused flag writes nothing."""
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
