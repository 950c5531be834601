"""``k3ir train`` options and output: the thread default follows the machine's load, ``--threads`` and
``--warmup`` are checked, ``--out`` refuses a directory holding another run or in use by another trainer, and the
closing summary says how many steps its means cover."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.cli import main


# ---- the summary says how many steps its means cover -------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2])
def test_train_summary_with_few_steps(capsys, tmp_path, steps):
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "k3-tiny", "--threads", "1", "--steps", str(steps), "--batch", "1",
                              "--seq", "16", "--no-plot", "--out", str(out))
    assert rc == 0, err
    done = next(ln for ln in stdout.splitlines() if ln.startswith("done: "))
    log = json.loads((out / "training.json").read_text())
    assert len(log["loss"]) == steps
    assert f"final loss={log['loss'][-1]:.6f}" in done
    assert "last 10" not in done and "last 20" not in done, done
    if steps == 1:
        assert "mean of last" not in done and "load (last step)" in done, done
    else:
        assert f"(mean of last 2 steps: {np.mean(log['loss']):.4f}; " in done, done
        assert f"load (mean of last 2 steps) {np.mean(log['worst_balance']):.3f}" in done, done


# ---- threads and warmup ------------------------------------------------------------------------------------
def test_default_threads_follow_the_load(monkeypatch):
    from k3ir.cli.train import default_threads
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


def test_negative_warmup_is_rejected(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "train", "k3-tiny", "--steps", "2", "--batch", "1", "--seq", "8", "--warmup", "-5",
                         "--out", str(tmp_path / "t"))
    assert rc == 2 and "--warmup must be >= 0, got -5" in err


# ---- --out into a directory holding another run, or in use -------------------------------------------------
def test_train_refuses_an_out_dir_holding_another_run(capsys, tmp_path):
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
    other = tmp_path / "other" / "checkpoints" / "step-000002"                     # resuming another run into it
    shutil.copytree(run / "checkpoints" / "step-000002", other)                   # an intact checkpoint elsewhere
    rc, _, err = run_cli(capsys, *common, "--out", str(run), "--resume", str(other))
    assert rc == 2 and f"--resume {other} belongs to another run" in one_line_error(err), err
    rc, out, err = run_cli(capsys, "train", "k3-tiny", "--resume", str(run), "--no-plot")   # its own run: allowed
    assert rc == 0 and "already complete (2/2 steps)" in out, (out, err)


def test_train_refuses_an_out_dir_in_use(capsys, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    from k3ir.cli.train import LOCK_FILE
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
