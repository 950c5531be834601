"""``k3ir export``: a flag that does not apply to the chosen format (or a form the format does not have) is a
usage error naming the flag and the format (exit 2, one line), and nothing is written; the form flags
(``--moe-form``, ``--mxfp4-form``, ``--kda-form``) reach the exporters."""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import one_line_error, run_cli


@pytest.mark.parametrize("fmt,flags,flag", [
    ("html", ["--quantize", "mxfp4"], "--quantize"),
    ("dot", ["--quantize", "none"], "--quantize"),
    ("svg", ["--moe-form", "sorted"], "--moe-form"),
    ("mlir", ["--moe-form", "loop"], "--moe-form"),          # a form only onnx has
    ("onnx", ["--moe-form", "dense"], "--moe-form"),         # a form only mlir has
    ("mlir", ["--mxfp4-form", "unpack"], "--mxfp4-form"),
    ("onnx", ["--kda-form", "scan"], "--kda-form"),
    ("html", ["--kda-form", "chunked"], "--kda-form"),
    ("onnx", ["--level", "op"], "--level"),
    ("mlir", ["--level", "layer"], "--level"),
    ("html", ["--level", "op"], "--level"),
    ("svg", ["--weights", "inputs"], "--weights"),
    ("onnx", ["--iree-target", "llvm-cpu"], "--iree-target"),
    ("svg", ["--logits-to-keep", "1"], "--logits-to-keep"),
    ("mlir", ["--logits-to-keep", "2"], "--logits-to-keep"),    # mlir compiles in 0 or 1 only
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


@pytest.mark.parametrize("flags,words", [
    (["--format", "onnx", "--mxfp4-form", "unpack"], ["--mxfp4-form", "--quantize mxfp4"]),   # float experts
    (["--format", "onnx", "--quantize", "mxfp4", "--opset", "20", "--mxfp4-form", "dequantize_linear"],
     ["--mxfp4-form dequantize_linear", "opset 27"]),
    (["--format", "mlir", "--quantize", "mxfp4", "--moe-form", "dense"], ["--moe-form dense", "MXFP4"]),
])
def test_form_flags_the_experts_or_opset_cannot_take_are_errors(capsys, tmp_path, flags, words):
    out = tmp_path / "tiny.out"
    rc, _, err = run_cli(capsys, "export", "k3-tiny", *flags, "-o", str(out))
    assert rc == 2
    one_line_error(err)
    assert all(w in err for w in words), err
    assert not out.exists()


def test_onnx_form_flags_reach_the_graph(capsys, tmp_path):
    """``--moe-form loop``: the routed experts as Loops and no per-expert Gemm at the top level (the default sorted
    form has one Gemm per expert and matrix); ``--mxfp4-form dequantize_linear``: FLOAT4E2M1 expert inputs and
    DequantizeLinear in place of the bit unpack."""
    onnx = pytest.importorskip("onnx")
    kinds = {}
    for name, flags in (("sorted", []), ("loop", ["--moe-form", "loop"]),
                        ("standard", ["--quantize", "mxfp4", "--mxfp4-form", "dequantize_linear"])):
        out = tmp_path / f"{name}.onnx"
        rc, _, err = run_cli(capsys, "export", "k3-tiny", "--format", "onnx", "--weights", "inputs", *flags,
                             "-o", str(out))
        assert rc == 0, err
        model = onnx.load(str(out))
        kinds[name] = (Counter(n.op_type for n in model.graph.node),
                       {i.type.tensor_type.elem_type for i in model.graph.input if ".experts." in i.name})
    assert kinds["sorted"][0]["Loop"] == 0 and kinds["loop"][0]["Loop"] > 0
    assert kinds["loop"][0]["Gemm"] < kinds["sorted"][0]["Gemm"]
    assert kinds["standard"][0]["DequantizeLinear"] > 0 and kinds["standard"][0]["BitShift"] == 0
    assert onnx.TensorProto.FLOAT4E2M1 in kinds["standard"][1]


def test_mlir_quantize_and_form_flags_reach_the_text(capsys, tmp_path):
    """``--format mlir --quantize mxfp4``: the routed experts are packed function arguments (``i4`` codes), decoded in
    the module; ``--moe-form dense --kda-form scan``: the earlier lowering (no chunk padding, an all-expert tensor)."""
    pytest.importorskip("iree.compiler")
    texts = {}
    for name, flags in (("mxfp4", ["--quantize", "mxfp4"]), ("default", []),
                        ("earlier", ["--moe-form", "dense", "--kda-form", "scan"])):
        out = tmp_path / f"{name}.mlir"
        rc, _, err = run_cli(capsys, "export", "k3-tiny", "--format", "mlir", "--function", "prefill", *flags,
                             "-o", str(out))
        assert rc == 0, err
        texts[name] = out.read_text()
    head = next(ln for ln in texts["mxfp4"].splitlines() if "func.func @prefill" in ln)
    assert "x32xi4>" in head and "i4 to i32" in texts["mxfp4"] and "i4 to i32" not in texts["default"]
    assert "tensor.pad" in texts["default"] and "tensor.pad" not in texts["earlier"]
    assert "x8x32xf32>" in texts["earlier"] and "x8x32xf32>" not in texts["default"]


def test_logits_to_keep_reaches_the_mlir_export(capsys, tmp_path):
    """``--format mlir --logits-to-keep 1``: @prefill returns ``[B,1,V]`` logits; without it ``[B,T,V]``."""
    for flags, logits in (([], "tensor<?x?x260xf32>"), (["--logits-to-keep", "1"], "tensor<?x1x260xf32>")):
        out = tmp_path / "t.mlir"
        rc, _, _ = run_cli(capsys, "export", "k3-tiny", "--format", "mlir", "--function", "prefill", *flags, "-o", str(out))
        head = out.read_text().splitlines()[1]
        assert rc == 0 and head.split("-> (")[1].startswith(logits), head[-200:]
