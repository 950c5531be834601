"""Fresh-user review findings (session 4): ``compile -o`` for a target that cannot build here,
a checkpoint directory without weights, the reference target's float64-only dtype, "did you
mean" suggestions, and the training thread default."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.backends import get_backend
from k3ir.runtime import Session
from k3ir.runtime.cli import main

import k3ir
from k3ir.errors import K3BackendError, K3CheckpointError, K3ConfigError

# ---- 1. compile -o for a target that cannot build here ------------------------------------------
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
    assert sorted(os.listdir(out)) == ["module.k3", "passes.json"]           # what the message says was written
    assert json.loads((out / "passes.json").read_text())["target"] == "tvm"


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
    monkeypatch.setenv("TRITON_INTERPRET", "0")            # conftest turns the CPU interpreter on: a plain CPU box
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


# ---- 2. a checkpoint directory without weights --------------------------------------------------
def _config_only(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    from k3ir.frontend.config import BUNDLED, BUNDLED_DIR
    with open(os.path.join(BUNDLED_DIR, BUNDLED["k3-tiny"])) as f:
        (d / "config.json").write_text(f.read())
    return d


def test_directory_without_safetensors_is_a_checkpoint_error(tmp_path, capsys):
    d = _config_only(tmp_path)
    with pytest.raises(K3CheckpointError) as e:
        k3ir.load(str(d))
    msg = str(e.value)
    assert msg.startswith(f"{d}: no weights") and "model.safetensors" in msg and "*.safetensors" in msg
    assert str(d / "config.json") in msg                                  # the explicit random-weights route
    for cmd in (["inspect", str(d)], ["compile", str(d), "--target", "torch", "--no-build"]):
        rc, _, err = run_cli(capsys, *cmd)
        assert rc == 2 and f"{d}: no weights" in one_line_error(err)
    m = k3ir.load(str(d / "config.json"))                                 # explicit: random init, as asked
    assert m.weights is None and len(m.params) == len(k3ir.load("k3-tiny").params)


# ---- 3. the reference target computes in float64 only --------------------------------------------
def test_reference_rejects_float32_python_and_cli(capsys):
    m = k3ir.load("k3-tiny")
    with pytest.raises(K3BackendError) as e:
        k3ir.compile(m, target="reference", dtype="float32")
    msg = str(e.value)
    assert msg.startswith("unsupported dtype 'float32' for target 'reference' (supported: float64)"), msg
    assert "target 'torch'" in msg
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "reference", "--dtype", "float32", "--no-build")
    assert rc == 2 and "supported: float64" in one_line_error(err)
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "reference", "--dtype", "bf16", "--no-build")
    assert rc == 2 and "unsupported dtype 'bf16'" in one_line_error(err)


def test_reference_default_and_float64_compute_in_float64():
    m = k3ir.load("k3-tiny")
    for dt in (None, "float64", "f64"):
        exe = k3ir.compile(m, target="reference", dtype=dt) if dt else k3ir.compile(m, target="reference")
        assert exe.dtype == "float64"
    ids = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
    ref = Session(k3ir.compile(m, target="reference"), seed=0).forward(ids)
    tor = Session(k3ir.compile(m, target="torch", dtype="float64"), seed=0).forward(ids)
    ref = np.asarray(ref)
    assert ref.dtype == np.float64
    assert np.abs(ref - tor.numpy()).max() <= 1e-9 * max(1.0, np.abs(ref).max())   # same math, both float64
    assert k3ir.compile(m, target="torch").dtype == "float32"            # other targets keep float32


# ---- 4. did you mean ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,near", [("kimi-k2", "kimi-k3"), ("k3tiny", "k3-tiny"), ("K3-Tiny", "k3-tiny"),
                                       ("kimi-linear", "kimi-linear-6p6b")])
def test_misspelt_model_suggests_a_bundled_name(capsys, name, near):
    with pytest.raises(K3ConfigError, match=f"did you mean '{near}'"):
        k3ir.load(name)
    rc, _, err = run_cli(capsys, "inspect", name)
    assert rc == 2 and f"did you mean '{near}'?" in one_line_error(err)


@pytest.mark.parametrize("name", ["zzz", "./kimi-k2", "models/k3tiny"])
def test_no_suggestion_for_far_names_or_paths(name):
    with pytest.raises(K3ConfigError) as e:
        k3ir.load(name)
    assert "did you mean" not in str(e.value) and "no such file" in str(e.value)


def test_misspelt_target_and_set_key_suggest(capsys):
    with pytest.raises(K3BackendError, match="did you mean 'torch'"):
        k3ir.compile(k3ir.load("k3-tiny"), target="torh")
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "tritn", "--no-build")
    assert rc == 2 and "unknown target 'tritn'" in err and "did you mean 'triton'?" in one_line_error(err)
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "cuda", "--no-build")
    assert rc == 2 and "'cuda' is a device, not a target" in one_line_error(err)
    rc, _, err = run_cli(capsys, "inspect", "k3-tiny", "--set", "hidden_sizee=3")
    assert rc == 2 and "did you mean 'hidden_size'?" in one_line_error(err)


# ---- 5. training threads ----------------------------------------------------------------------------
def test_default_threads_follow_the_load(monkeypatch):
    from k3ir.runtime.cli_train import default_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = max(1, min(len(os.sched_getaffinity(0)), torch.get_num_threads()))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert default_threads()[0] == cores
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 3.0, 0.0, 0.0))      # busier than the cores
    n, why = default_threads()
    assert n == 1 and "load average" in why and "--threads" in why
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 1.2, 0.0, 0.0))      # about one core left
    assert default_threads()[0] == max(1, cores - round(cores - 1.2))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == (torch.get_num_threads(), "OMP_NUM_THREADS")


def test_train_threads_flag_checked_and_documented(capsys):
    rc, _, err = run_cli(capsys, "train", "--threads", "0", "--steps", "1")
    assert rc == 2 and "--threads must be >= 1" in one_line_error(err)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads 1" in text and "load average" in text


@pytest.mark.parametrize("device, words", [("tpu", "unknown device 'tpu'"), ("mps", "device 'mps' is not supported"),
                                           ("CPU", "unknown device 'CPU'"), ("meta", "device 'meta' is not supported")])
def test_unusable_device_is_a_usage_error_before_any_work(capsys, device, words):
    """``--device`` tpu/mps/meta/CPU: exit 2 with one line from argparse (was a torch traceback after the passes)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:                 # argparse: usage line + one error line, exit 2
        main(["compile", "k3-tiny", "--target", "torch", "--device", device])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and f"argument --device: {words}" in err and "Traceback" not in err


def test_negative_warmup_is_rejected(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "train", "k3-tiny", "--steps", "2", "--batch", "1", "--seq", "8", "--warmup", "-5",
                      "--out", str(tmp_path / "t"))
    assert rc == 2 and "--warmup must be >= 0, got -5" in err


def test_generate_takes_threads(capsys):
    """``--threads`` (README: "on a shared machine pass --threads 1") works on generate too; 0 is an error."""
    before = torch.get_num_threads()
    try:
        rc, out, _ = run_cli(capsys, "generate", "k3-tiny", "--prompt", "Kimi ", "--max-tokens", "2", "--threads", "1")
        assert rc == 0 and out.startswith("Kimi ") and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)            # the rest of the suite runs in this process
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--threads", "0")
    assert rc == 2 and "--threads must be >= 1, got 0" in err
