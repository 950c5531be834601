"""``k3ir compile`` without a build: for a target that cannot build on this machine ``-o`` is an error that writes
nothing and says how to ask for IR only (``--ir-only`` / ``--no-build``); without ``-o`` the pipeline runs with a
note, and ``--ir-only`` without ``-o`` says nothing was written."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.backends import get_backend
from k3ir.cli import main

import k3ir

TVM_MISSING = "apache-tvm is not installed (pip install 'k3ir[tvm]')"     # what backends/tvm says without tvm


def test_compile_output_for_unbuildable_target_is_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(get_backend("tvm"), "available", lambda: TVM_MISSING)
    out = tmp_path / "art"
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "tvm", "-o", str(out))
    assert rc == 2
    line = one_line_error(err)
    for needle in ("target 'tvm' cannot build here", "pip install 'k3ir[tvm]'", str(out), "module.k3",
                   "passes.json", "--ir-only"):
        assert needle in line, (needle, line)
    assert "nothing written to" in line and not out.exists()              # -o promised an artifact: no IR alone


@pytest.mark.parametrize("flag", ["--ir-only", "--no-build"])
def test_compile_ir_only_is_the_explicit_way(capsys, tmp_path, monkeypatch, flag):
    monkeypatch.setattr(get_backend("tvm"), "available", lambda: TVM_MISSING)
    out = tmp_path / "ir"
    rc, stdout, err = run_cli(capsys, "compile", "k3-tiny", "--target", "tvm", "-o", str(out), flag)
    assert rc == 0 and err == ""
    assert sorted(os.listdir(out)) == ["module.k3", "passes.json"]
    assert "build skipped" in stdout
    m = k3ir.parse_file(str(out / "module.k3"))                             # the IR is usable on its own
    k3ir.verify_module(m)


def test_compile_without_output_keeps_the_note(capsys, monkeypatch):
    monkeypatch.setattr(get_backend("tvm"), "available", lambda: TVM_MISSING)
    rc, stdout, _ = run_cli(capsys, "compile", "k3-tiny", "--target", "tvm")
    stdout = " ".join(stdout.split())                   # rich wraps long lines
    assert rc == 0 and "cannot build here" in stdout and "ran its pipeline only" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_compile_triton_output_without_gpu_names_the_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")            # a plain CPU box, without the Triton interpreter
    if get_backend("triton").available() is None:
        pytest.skip("triton usable here")
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "triton", "-o", str(tmp_path / "t"))
    assert rc == 2
    line = one_line_error(err)
    assert "no CUDA GPU" in line or "Triton is not installed" in line, line


def test_compile_help_documents_ir_only(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ir-only" in text and "exit 2" in text


def test_ir_only_without_output_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--ir-only")
    out = " ".join(out.split())                  # rich wraps long lines
    assert rc == 0 and err == ""
    assert "no -o given, so nothing was written (-o DIR writes the IR: module.k3 and passes.json)" in out
    assert os.listdir(tmp_path) == []


def test_triton_decode_phase_dump_shows_the_decode_fused_ops(capsys, tmp_path):
    """``k3ir compile k3-tiny --target triton --ir-only --dump-ir DIR``: the decode phase's dumps hold the ops the
    decode-step kernels run (k3.decode_linear, k3.fused_kda_ungated, k3.mla_kv_norm, k3.moe_experts, the KDA
    input norms in the layers) in the decode function; the dump before that phase has none, and the prefill
    function keeps k3.fused_kda (the KDA output pass is for decode steps). k3-tiny's latent MoE has no
    k3.moe_front: its router reads the norm, its dispatch the latent."""
    dump = tmp_path / "dump"
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "triton", "--ir-only", "--dump-ir", str(dump))
    assert rc == 0, err
    files = sorted(os.listdir(dump))
    assert [f.split("-", 1)[1] for f in files if "-decode." in f] == [
        "decode.fuse-decode-linear.k3", "decode.fuse-kda-output.k3", "decode.fuse-mla-kv-norm.k3",
        "decode.fuse-moe-experts.k3", "decode.fuse-moe-front.k3", "decode.fuse-decode-norm.k3"]
    before = k3ir.parse_file(str(dump / next(f for f in files if f.endswith("specialize.absorb-mla.k3"))))
    after = k3ir.parse_file(str(dump / files[-1]))
    assert not any(o.name == "k3.decode_linear" for o in before.ops())
    decode = {o.name for o in after.functions["decode"].ops}
    assert {"k3.decode_linear", "k3.fused_kda_ungated", "k3.mla_kv_norm"} <= decode and "k3.mla" not in decode
    norms = {o.attrs["norm"] for o in after.functions["decode"].ops if o.name == "k3.decode_linear"}
    assert norms == {"none", "rms", "gated"}
    assert "k3.fused_kda_ungated" not in {o.name for o in after.functions["prefill"].ops}
    ops = after.functions["decode"].ops
    assert sum(o.name == "k3.moe_experts" and o.attrs["glu"] and o.attrs["combine"] for o in ops) == 8
    assert not any(o.name in ("k3.grouped_matmul", "k3.moe_combine", "k3.moe_front") for o in ops)
    assert any(o.name == "k3.fused_kda" and o.attrs["norm"] == "rms" for o in ops)
