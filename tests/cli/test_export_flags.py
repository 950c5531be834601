"""``k3ir export``: a flag that does not apply to the chosen format is a usage error naming the flag and
the format (exit 2, one line), and nothing is written."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli


@pytest.mark.parametrize("fmt,flags,flag", [
    ("mlir", ["--quantize", "mxfp4"], "--quantize"),
    ("mlir", ["--quantize", "none"], "--quantize"),
    ("html", ["--quantize", "mxfp4"], "--quantize"),
    ("onnx", ["--level", "op"], "--level"),
    ("mlir", ["--level", "layer"], "--level"),
    ("html", ["--level", "op"], "--level"),
    ("svg", ["--weights", "inputs"], "--weights"),
    ("onnx", ["--iree-target", "llvm-cpu"], "--iree-target"),
])
def test_flag_that_does_not_apply_to_the_format_is_an_error(capsys, tmp_path, fmt, flags, flag):
    out = tmp_path / f"tiny.{fmt}"
    rc, _, err = run_cli(capsys, "export", "k3-tiny", "--format", fmt, *flags, "-o", str(out))
    assert rc == 2
    one_line_error(err)
    assert flag in err and fmt in err
    assert not out.exists()


def test_level_still_applies_to_svg_and_dot(capsys, tmp_path):
    out = tmp_path / "tiny.dot"
    rc, stdout, err = run_cli(capsys, "export", "k3-tiny", "--format", "dot", "--level", "op", "-o", str(out))
    assert rc == 0, err
    assert "op level" in stdout and out.stat().st_size > 0
