"""Fresh-user review s4, minor findings (notes/review_s4.md): tvm cross targets without TVM (F18),
non-finite config floats (F8), fused KDA chunk size (F16), tokenizer hint for bundled names (F25),
a checkpoint pointer passed as MODEL (F15) and ``train --out`` into another run (F11)."""
from __future__ import annotations

import importlib.util

import pytest
from conftest import one_line_error, run_cli, tiny_config_file
from k3ir.passes.manager import make_pass

import k3ir
from k3ir.errors import K3ConfigError, K3Error


# ---- F18: tvm cross targets when apache-tvm is missing ------------------------------------------
def test_tvm_cross_targets_unavailable_without_tvm(monkeypatch):
    from k3ir.backends import get_backend
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tvm" else real(name, *a))
    for kind in ("c", "cuda", "metal", "rocm"):
        why = get_backend(f"tvm-{kind}").available()
        assert why is not None and "apache-tvm is not installed" in why and "k3ir[tvm]" in why, why
        assert "builds" not in why, why
    assert "k3ir[tvm]" in get_backend("tvm").available()
    monkeypatch.undo()
    if importlib.util.find_spec("tvm") is not None:     # with TVM the cross rows keep their own reason
        assert "builds c code here" in get_backend("tvm-c").available()


# ---- F8: non-finite / non-positive floats in a config.json ---------------------------------------
def test_config_rejects_nan_eps_at_load(capsys, tmp_path):
    for value, what in ((float("nan"), "must be finite, got nan"), (float("inf"), "must be finite, got inf"),
                        (0.0, "must be > 0, got 0.0"), (-1e-6, "must be > 0, got -1e-06")):
        path = tiny_config_file(tmp_path, "text_config", "rms_norm_eps", value)
        rc, _, err = run_cli(capsys, "inspect", path)
        assert rc == 2, (value, err)
        line = one_line_error(err)
        assert "c_bad.json" in line and "'text_config.rms_norm_eps'" in line and what in line, line
    path = tiny_config_file(tmp_path, "text_config", "activation_situ_beta", float("-inf"))
    with pytest.raises(K3ConfigError, match="activation_situ_beta.*must be finite"):
        k3ir.frontend.load_config(path)
    path = tiny_config_file(tmp_path, "text_config", "rms_norm_eps", 1e-5)   # a finite positive eps still loads
    assert k3ir.frontend.load_config(path).rms_norm_eps == 1e-5


# ---- F16: fuse-kda-chunks options ----------------------------------------------------------------
def test_fuse_kda_chunk_size_checked_naming_the_option(capsys):
    for bad in (0, -3, 24):
        rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--no-build",
                          "--passes", f"fuse-kda-chunks{{chunk_size={bad}}},dce")
        assert rc == 2, err
        line = one_line_error(err)
        assert "pass 'fuse-kda-chunks' option 'chunk_size'" in line and f"got {bad}" in line, line
        assert "positive multiple of 16" in line, line
    with pytest.raises(K3Error, match="option 'mode': must be auto, chunk or recurrent, got 'fast'"):
        make_pass("fuse-kda-chunks{mode=fast}")
    assert make_pass("fuse-kda-chunks{chunk_size=48}").chunk_size == 48
    assert make_pass("fuse-kda-chunks").chunk_size == 0            # default: each layer keeps its own


# ---- F25: tokenizer hint for a bundled name ------------------------------------------------------
def test_generate_bundled_name_without_tokenizer(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "kimi-k3", "--prompt", "x", "--max-tokens", "2")
    assert rc == 2, err
    line = one_line_error(err)
    assert "'kimi-k3': it is a bundled config without a tokenizer" in line, line
    assert "checkpoint directory" in line and "tokenizer.json" in line and "put tokenizer.json" not in line, line
    from types import SimpleNamespace

    from k3ir.runtime.tokenizer import load_tokenizer
    (tmp_path / "config.json").write_text("{}")          # a directory: the hint names it
    with pytest.raises(K3ConfigError, match=f"put tokenizer.json or tiktoken.model in {tmp_path}"):
        load_tokenizer(str(tmp_path), SimpleNamespace(attrs={"vocab_size": 1000}))


# ---- F15: a run's checkpoints/latest pointer passed as MODEL ------------------------------------
def test_checkpoint_pointer_as_model(capsys, tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    (ck / "step-000080").mkdir(parents=True)
    (ck / "latest").write_text("step-000080\n")            # what train_checkpoint.save_checkpoint writes
    rc, _, err = run_cli(capsys, "generate", str(ck / "latest"), "--prompt", "The ", "--max-tokens", "4")
    assert rc == 2, err
    line = one_line_error(err)
    assert f"{ck / 'latest'}: is a training run's checkpoint pointer (it names step-000080)" in line, line
    assert f"pass the checkpoint directory {ck / 'step-000080'}" in line and "invalid JSON" not in line, line
    other = tmp_path / "latest"                              # a stray file called latest: still plain JSON error
    other.write_text("not json\n")
    with pytest.raises(K3ConfigError, match="invalid JSON at line 1"):
        k3ir.load(str(other))


# ---- F11: train --out into a directory holding another run ---------------------------------------
def test_train_refuses_an_out_dir_holding_another_run(capsys, tmp_path):
    import json
    run = tmp_path / "run"
    common = ["train", "k3-tiny", "--threads", "1", "--batch", "1", "--seq", "16", "--no-plot", "--log-every", "1"]
    rc, out, err = run_cli(capsys, *common, "--steps", "2", "--out", str(run))
    assert rc == 0 and (run / "checkpoints" / "step-000002").is_dir(), err
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rc, out, err = run_cli(capsys, *common, "--steps", "3", "--out", str(run))          # a new run into it
    assert rc == 2, err
    line = one_line_error(err)
    assert f"--out {run} already holds a training run (k3-tiny at step 2/2)" in line, line
    assert f"pass --resume {run} to continue it" in line and "step 1/" not in out, (line, out)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before      # nothing written
    other = tmp_path / "other" / "checkpoints" / "step-000001"                     # resuming another run into it
    other.mkdir(parents=True)
    (other / "trainer.json").write_text(json.dumps({"step": 1, "config": {"steps": 5}, "model": "k3-tiny"}))
    rc, _, err = run_cli(capsys, *common, "--out", str(run), "--resume", str(other))
    assert rc == 2 and f"--resume {other} belongs to another run" in one_line_error(err), err
    rc, out, err = run_cli(capsys, "train", "k3-tiny", "--resume", str(run), "--no-plot")   # its own run: allowed
    assert rc == 0 and "already complete (2/2 steps)" in out, (out, err)


def test_train_refuses_an_out_dir_in_use(capsys, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    from k3ir.runtime.cli_train import LOCK_FILE
    run = tmp_path / "live"
    run.mkdir()
    with open(run / LOCK_FILE, "w") as held:                 # another trainer holds the run directory
        held.write("4242\n")
        held.flush()
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, out, err = run_cli(capsys, "train", "k3-tiny", "--threads", "1", "--steps", "1", "--batch", "1",
                            "--seq", "16", "--no-plot", "--out", str(run))
    assert rc == 2, err
    assert f"--out {run} is in use by another k3ir train (pid 4242)" in one_line_error(err), err
    assert not (run / "checkpoints").exists() and "step 1/" not in out
