"""``k3ir export --format onnx --function F`` for a function the onnx target does not build (``@encode_images``)
is refused before any export, with the reason ``k3ir check --target onnx`` gives, and nothing is written."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli

pytest.importorskip("onnx")


@pytest.mark.parametrize("extra", [[], ["--describe"]])
def test_export_onnx_unbuilt_function_is_refused(capsys, tmp_path, extra):
    out = tmp_path / "x.onnx"
    argv = ["export", "k3-tiny", "--format", "onnx", "--function", "encode_images"]
    rc, stdout, err = run_cli(capsys, *argv, *(extra or ["-o", str(out)]))
    assert rc == 2 and stdout == ""
    assert one_line_error(err) == ("k3ir: error: --function encode_images: target 'onnx' builds only forward, "
                                   "prefill, decode")
    assert list(tmp_path.iterdir()) == []
    rc, check_out, _ = run_cli(capsys, "check", "k3-tiny", "--target", "onnx")
    assert "@encode_images unsupported (target 'onnx' builds only forward, prefill, decode" in check_out


def test_export_onnx_decode_still_exports(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "export", "k3-tiny", "--format", "onnx", "--function", "decode", "--describe")
    assert rc == 0, err
