"""Training runtime: schedule, QB (incl. the histogram quantiles of data-parallel runs), a short
k3-tiny run (loss falls, QB balances better than none), activation checkpointing, atomic
checkpoints, and kill -9 + resume reproducing the uninterrupted loss sequence exactly."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from k3ir.runtime.qb import (
    hist_quantile,
    hist_ranges,
    load_balance,
    local_histograms,
    moe_layers,
    qb_update_hist,
    qb_values,
)
from k3ir.runtime.train_data import ByteBatches, read_bytes
from k3ir.runtime.trainer import TrainConfig, Trainer, decays, lr_at

import k3ir
from k3ir.balancing import qb_update


@pytest.fixture(scope="module")
def exe():
    return k3ir.compile(k3ir.load("k3-tiny"), target="torch", dtype="float32")


# ---- schedule and parameter groups ---------------------------------------------------------------
def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=110, lr=1e-3, warmup=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)                      # cosine starts at the peak
    assert lr_at(cfg, 60) == pytest.approx(1e-4 + 0.5 * 9e-4)          # half way: cos(pi/2) = 0
    assert lr_at(cfg, 110) == pytest.approx(1e-4)


def test_weight_decay_only_on_matrices():
    assert decays("x.q_proj.weight", (32, 64))
    assert decays("x.experts.{e}.w1.weight", (8, 32, 32))
    assert not decays("x.input_layernorm.weight", (64,))
    assert not decays("x.self_attention_res_proj.weight", (1, 64))
    assert not decays("x.self_attn.A_log", (1, 1, 2, 1))
    assert not decays("x.self_attn.dt_bias", (32,))


# ---- QB ------------------------------------------------------------------------------------------
def test_load_balance_primer_example():
    """SPEC.md 6: columns (0.8,0.6,0.3,0.5), (0.2,0.4,0.7,0.5), k=1; unbiased routes (3,1) -> max/mean 1.5
    (ties to the lower index); the quantile bias routes (2, 2) -> 1.0."""
    s = np.array([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    load, ratio = load_balance(s, np.zeros(2), 1)
    assert load.tolist() == [3, 1] and ratio == 1.5
    b = qb_update(s, np.zeros(2), 1, "quantile")
    load, ratio = load_balance(s, b, 1)
    assert load.tolist() == [2, 2] and ratio == 1.0


@pytest.mark.parametrize("rule", ["quantile", "margin"])
def test_histogram_quantile_matches_exact_within_a_bin(rule, rng):
    m, E, k = 3000, 8, 2
    s = 1 / (1 + np.exp(-rng.normal(size=(m, E)) * 1.5 - rng.normal(size=E)))
    b = rng.normal(size=E) * 0.1
    vals = qb_values(s, b, k, rule)
    lo, hi = hist_ranges(b, rule)
    assert np.all(vals >= lo) and np.all(vals <= hi)                     # the documented range covers all
    bins = 2048
    width = (hi - lo) / bins
    q = 1 - k / E
    exact = np.quantile(vals, q, axis=0)
    # data parallel: 3 ranks' histograms summed == the global histogram
    shards = np.array_split(np.arange(m), 3)
    summed = sum(local_histograms(vals[i], lo, hi, bins) for i in shards)
    assert np.array_equal(summed, local_histograms(vals, lo, hi, bins))
    approx = hist_quantile(summed, lo, hi, q)
    assert np.all(np.abs(approx - exact) <= width)
    # the full update, with the sum over ranks as the all-reduce
    parts = [s[i] for i in shards]
    hist_sum = sum(local_histograms(qb_values(p, b, k, rule), lo, hi, bins) for p in parts)
    new = qb_update_hist(parts[0], b, k, rule, bins=bins, all_reduce=lambda h: hist_sum)
    want = qb_update(s, b, k, rule)
    assert np.max(np.abs(new - want)) <= 2 * width.max()


def test_histogram_quantile_small_hand_case():
    """Four values 0.1, 0.2, 0.3, 0.4 in [0, 1) with 10 bins: the 0.5 quantile (rank 1.5) lies in
    bin 2 ([0.2, 0.3)) at fraction (1.5 - 1 + 0.5) / 1 of it -> 0.3 (NumPy: 0.25; error < a bin)."""
    h = local_histograms(np.array([[0.1], [0.2], [0.3], [0.4]]) + 1e-9, np.zeros(1), np.ones(1), 10)
    assert h[0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    got = hist_quantile(h, np.zeros(1), np.ones(1), 0.5)[0]
    assert abs(got - 0.25) <= 0.1


def test_moe_layers_found_with_bias_and_router_weight():
    m = k3ir.load("k3-tiny")
    layers = moe_layers(m)
    assert [x.layer for x in layers] == list(range(1, 9))             # first_k_dense_replace = 1
    assert all(x.bias.endswith("gate.e_score_correction_bias") and x.weight.endswith("gate.weight") for x in layers)
    assert all(x.experts == 8 and x.top_k == 2 for x in layers)


# ---- a short training run ---------------------------------------------------------------------------
def _run(exe, qb, steps=20, **kw):
    torch.manual_seed(0)
    cfg = TrainConfig(steps=steps, batch=4, seq=32, warmup=4, lr=3e-3, qb=qb, **kw)
    tr = Trainer(exe, cfg)
    data = ByteBatches(read_bytes(), cfg.batch, cfg.seq, seed=0)
    return tr, [tr.train_step(data.batch_at(i)) for i in range(steps)]


@pytest.fixture(scope="module")
def unbalanced_run(exe):
    return _run(exe, "none")[1]


@pytest.mark.parametrize("rule", ["quantile", "margin"])
def test_short_run_loss_falls_and_qb_balances_better_than_none(exe, unbalanced_run, rule):
    none = unbalanced_run
    tr, qb = _run(exe, rule)
    first = none[0].loss
    assert abs(first - math.log(260)) < 0.05                          # uniform-ish at init: ln(vocab)
    for hist in (none, qb):
        assert np.mean([s.loss for s in hist[-5:]]) < first - 0.5
    worst_none = np.mean([s.worst_balance for s in none[-10:]])
    worst_qb = np.mean([s.worst_balance for s in qb[-10:]])
    assert worst_qb < worst_none, (worst_qb, worst_none)
    assert len(qb[-1].balance) == 8
    # the QB bias is set by the balancer, never by the optimizer
    b = tr.params[tr.layers[0].bias]
    assert not b.requires_grad and abs(float(b.sum())) < 1e-5        # centred: c - mean(c)


def test_activation_checkpointing_gives_identical_steps(exe):
    _, a = _run(exe, "quantile", steps=3)
    _, b = _run(exe, "quantile", steps=3, checkpointing=True)
    assert [s.loss for s in a] == [s.loss for s in b]
    assert [s.balance for s in a] == [s.balance for s in b]


def _snapshot(tr):
    return {n: p.detach().clone() for n, p in tr.params.items()}


def _unchanged(tr, before):
    return all(torch.allclose(tr.params[n].detach(), v, rtol=0, atol=0, equal_nan=True) for n, v in before.items())


def test_nan_loss_names_the_logged_step_without_a_warning(exe):
    """The CLI logs steps from 1; the error names the step that failed, raises no torch
    UserWarning (float() of a tensor with grad) and applies nothing."""
    import warnings
    torch.manual_seed(0)
    cfg = TrainConfig(steps=4, batch=2, seq=16, warmup=0, lr=1e-3, qb="quantile")
    tr = Trainer(exe, cfg)
    data = ByteBatches(read_bytes(), cfg.batch, cfg.seq, seed=0)
    tr.train_step(data.batch_at(0))
    name = next(n for n in tr.trainable if n.endswith("q_proj.weight"))
    tr.set_params({name: torch.full_like(tr.params[name], float("nan"))})
    before = _snapshot(tr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(k3ir.K3RuntimeError, match=r"^loss is nan at step 2; the step was not applied"):
            tr.train_step(data.batch_at(1))
    assert tr.step == 1 and len(tr.history) == 1 and _unchanged(tr, before)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_non_finite_gradient_is_not_applied(exe, clip):
    """A finite loss whose gradient overflows (here: a hook makes one gradient NaN) stops
    training before the optimizer or QB touch any parameter."""
    torch.manual_seed(0)
    cfg = TrainConfig(steps=4, batch=2, seq=16, warmup=0, lr=1e-3, clip=clip, qb="quantile")
    tr = Trainer(exe, cfg)
    data = ByteBatches(read_bytes(), cfg.batch, cfg.seq, seed=0)
    name = next(n for n in tr.trainable if n.endswith("q_proj.weight"))
    tr.params[name].register_hook(lambda g: g * float("nan"))
    before = _snapshot(tr)
    with pytest.raises(k3ir.K3RuntimeError, match=r"^gradient norm is nan at step 1 \(loss 5\.\d+\); the step was not"):
        tr.train_step(data.batch_at(0))
    assert tr.step == 0 and not tr.history and _unchanged(tr, before) and not tr.opt.state


def test_trainer_rejects_reference_target():
    ref = k3ir.compile(k3ir.load("k3-tiny"), target="reference")
    with pytest.raises(k3ir.K3RuntimeError, match="torch"):
        Trainer(ref)


# ---- checkpoints ---------------------------------------------------------------------------------------
def test_checkpoint_layout_and_in_process_resume(exe, tmp_path):
    from k3ir.runtime.train_checkpoint import load_checkpoint, save_checkpoint
    from safetensors import safe_open
    tr, _hist = _run(exe, "quantile", steps=3)
    d = save_checkpoint(tmp_path, tr)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "train_state", "trainer.json"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]   # no temp left
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        e3 = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight"      # one key per expert
        name = "language_model.model.layers.2.block_sparse_moe.experts.{e}.w1.weight"
        assert e3 in set(f.keys()) and torch.equal(f.get_tensor(e3), tr.params[name][3])
    loaded = k3ir.load(str(d))                                         # the model dir loads as a checkpoint
    assert all(np.array_equal(np.asarray(loaded.weights[n]), tr.params[n].detach().numpy()) for n in tr.params)
    tr2 = Trainer(exe, tr.cfg)
    load_checkpoint(tmp_path, tr2)
    data = ByteBatches(read_bytes(), 4, 32, seed=0)
    assert tr2.step == 3 and all(torch.equal(tr.params[n], tr2.params[n]) for n in tr.params)
    assert tr.train_step(data.batch_at(3)).loss == tr2.train_step(data.batch_at(3)).loss


def _cli(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "k3ir.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def _history(run_dir: Path) -> list[float]:
    ck = run_dir / "checkpoints"
    meta = json.loads((ck / (ck / "latest").read_text().strip() / "trainer.json").read_text())
    return [h["loss"] for h in meta["history"]]


def test_kill_and_resume_reproduces_the_loss_sequence(tmp_path):
    """SIGKILL `k3ir train` right after a checkpoint, resume from it: the final loss history equals
    an uninterrupted run's bit for bit (CPU)."""
    common = ["--steps", "24", "--batch", "2", "--seq", "16", "--warmup", "3", "--ckpt-every", "4",
              "--log-every", "1", "--threads", "1", "--no-plot"]
    full = _cli([*common, "--out", str(tmp_path / "full")])
    out, err = full.communicate(timeout=300)
    assert full.returncode == 0, err
    printed = [float(x.split("loss=")[1].split()[0]) for x in out.splitlines() if x.startswith("step ")]
    assert len(printed) == 24
    want = _history(tmp_path / "full")
    assert len(want) == 24 and np.allclose(printed, want, rtol=0, atol=5e-7)   # printed with 6 decimals

    run = tmp_path / "killed"
    p = _cli([*common, "--out", str(run)])
    latest = run / "checkpoints" / "latest"
    t0 = time.time()
    while time.time() - t0 < 240:
        if latest.exists() and latest.read_text().strip() >= "step-000008":
            break
        if p.poll() is not None:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    at = latest.read_text().strip()
    assert p.returncode == -signal.SIGKILL and at < "step-000024", "the run ended before it could be killed"
    r = _cli([*common, "--out", str(run), "--resume", str(run)])
    out, err = r.communicate(timeout=300)
    assert r.returncode == 0, err
    assert f"steps {int(at.split('-')[1])}->24" in out
    assert _history(run) == want                                     # exact float equality


def test_cli_errors_exit_2_with_one_line(tmp_path):
    p = _cli(["--data", str(tmp_path / "missing.txt"), "--steps", "1", "--out", str(tmp_path)])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "missing.txt" in err and "Traceback" not in err
    p = _cli(["--resume", str(tmp_path / "nothing"), "--out", str(tmp_path)])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "no training checkpoint" in err and "Traceback" not in err


def test_cli_writes_plot_and_summary(tmp_path):
    p = _cli(["--steps", "3", "--batch", "2", "--seq", "16", "--warmup", "1", "--qb", "sign", "--out", str(tmp_path),
              "--threads", "1"])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert out.count("loss=") >= 3
    png = (tmp_path / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "training.json").read_text())
    assert summary["qb"] == "sign" and len(summary["loss"]) == 3 and len(summary["per_layer_balance_20"]) == 8


def test_resume_keeps_the_run_settings(tmp_path):
    """--log-every/--ckpt-every/--threads are saved with the run: a plain --resume logs at the
    original cadence (every step here) instead of the default every 10."""
    import subprocess
    import sys
    out = tmp_path / "run"
    base = [sys.executable, "-m", "k3ir.cli", "train"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(base + ["k3-tiny", "--steps", "4", "--ckpt-every", "2", "--log-every", "1", "--threads", "1",
                           "--batch", "2", "--seq", "16", "--out", str(out), "--no-plot"],
                   check=True, capture_output=True, text=True, env=env)
    res = subprocess.run(base + ["--resume", str(out / "checkpoints" / "step-000002"), "--no-plot"],
                         check=True, capture_output=True, text=True, env=env)
    steps = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert steps == ["3/4", "4/4"]
    assert "torch threads 1" in res.stdout


@pytest.mark.parametrize("ckpt_every,stop_at,says", [
    ("100", 3, ("k3ir: interrupted: at step 3/6 (2 steps done); no checkpoint written (the first is at step 6; "
               "--ckpt-every sets the interval)")),
    ("2", 4, ("k3ir: interrupted: at step 4/6 (3 steps done); the last checkpoint is step 2: continue with k3ir "
             "train --resume {out}")),
])
def test_ctrl_c_says_what_is_left_and_removes_the_lock(capsys, monkeypatch, tmp_path, ckpt_every, stop_at, says):
    """Ctrl-C (KeyboardInterrupt) during step ``stop_at``: one line saying which checkpoint
    (if any) exists, rc 130, and no lock file left behind."""
    from conftest import run_cli
    from k3ir.cli import train as cli_train
    from k3ir.runtime import trainer
    real = trainer.Trainer.train_step

    def step(self, batch):
        if self.step + 1 == stop_at:
            raise KeyboardInterrupt
        return real(self, batch)
    monkeypatch.setattr(trainer.Trainer, "train_step", step)
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "k3-tiny", "--steps", "6", "--batch", "2", "--seq", "8", "--threads", "1",
                         "--ckpt-every", ckpt_every, "--no-plot", "--out", str(out))
    assert rc == 130 and err.splitlines()[-1] == says.format(out=out), err
    assert not (out / cli_train.LOCK_FILE).exists()
    ck = sorted(p.name for p in (out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else []
    assert ck == ([] if ckpt_every == "100" else ["step-000002"])


def test_clean_exit_removes_the_lock(capsys, tmp_path):
    from conftest import run_cli
    from k3ir.cli import train as cli_train
    rc, out, err = run_cli(capsys, "train", "k3-tiny", "--steps", "1", "--batch", "2", "--seq", "8", "--threads", "1",
                           "--no-plot", "--out", str(tmp_path))
    assert rc == 0, err
    assert "done: final loss=" in out and not (tmp_path / cli_train.LOCK_FILE).exists()
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_train_parameter_line_splits_off_the_vision_tower(capsys, tmp_path):
    """Train's parameter count includes the vision tower; the line says so, and its language-model
    part equals what ``inspect`` reports."""
    from conftest import run_cli

    from k3ir.accounting import report
    total = report(k3ir.load("k3-tiny")).params_total
    rc, out, err = run_cli(capsys, "train", "k3-tiny", "--steps", "1", "--batch", "1", "--seq", "8", "--threads", "1",
                           "--no-plot", "--out", str(tmp_path))
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("training k3-tiny: "))
    n_all, lm, vis = (int(x.replace(",", "")) for x in
                      (line.split(": ")[1].split()[0], line.split("(")[1].split()[0], line.split("+ ")[1].split()[0]))
    assert lm == total and vis > 0 and n_all == lm + vis, line


# ---- run directory and extending a finished run ------------------------------------------------------------
def test_lr_schedule_keeps_its_planned_end_when_extended():
    planned = TrainConfig(steps=10, lr=1e-3, warmup=2, min_lr_ratio=0.1)
    extended = TrainConfig(steps=16, lr=1e-3, warmup=2, min_lr_ratio=0.1, schedule_steps=10)
    assert [lr_at(extended, s) for s in range(10)] == [lr_at(planned, s) for s in range(10)]     # bit for bit
    assert [lr_at(extended, s) for s in range(10, 16)] == [1e-3 * 0.1] * 6                       # the final rate


def test_fresh_run_without_out_writes_into_a_new_run_directory(capsys, tmp_path, monkeypatch):
    import re

    from conftest import run_cli
    monkeypatch.chdir(tmp_path)
    argv = ("train", "k3-tiny", "--steps", "1", "--batch", "1", "--seq", "8", "--threads", "1", "--no-plot")
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert os.listdir(tmp_path) == ["runs"]                                   # nothing in the current directory
    (run,) = os.listdir(tmp_path / "runs")
    assert re.fullmatch(r"k3-tiny-\d{8}-\d{6}", run), run
    assert f"run directory: {Path('runs') / run} " in out
    assert (tmp_path / "runs" / run / "checkpoints" / "step-000001" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / run / "training.json").is_file()
    rc, out, err = run_cli(capsys, *argv)                                    # a second run: its own directory
    assert rc == 0 and len(os.listdir(tmp_path / "runs")) == 2, err


def test_finished_run_extends_bit_exactly(capsys, tmp_path, exe):
    """``--resume RUN --steps 6`` after a finished 4-step run: the first 4 losses stay the original's bit for bit,
    the run reaches step 6, the added steps run at lr * min_lr_ratio, and all 6 equal one uninterrupted in-process
    run planned the same way (TrainConfig(steps=6, schedule_steps=4))."""
    from conftest import run_cli
    run = tmp_path / "run"
    common = ("--batch", "2", "--seq", "8", "--warmup", "1", "--threads", "1", "--no-plot")
    rc, _, err = run_cli(capsys, "train", "k3-tiny", "--steps", "4", *common, "--out", str(run))
    assert rc == 0, err
    first = json.loads((run / "training.json").read_text())["loss"]
    rc, out, err = run_cli(capsys, "train", "--resume", str(run), "--steps", "6", "--threads", "1", "--no-plot")
    assert rc == 0, err
    assert "extended run: steps 5-6 at the schedule's final learning rate 3.00e-04" in out
    meta = json.loads((run / "checkpoints" / "step-000006" / "trainer.json").read_text())
    assert meta["step"] == 6 and meta["config"]["steps"] == 6 and meta["config"]["schedule_steps"] == 4
    losses = [h["loss"] for h in meta["history"]]
    assert len(losses) == 6 and losses[:4] == first
    assert [h["lr"] for h in meta["history"][4:]] == [3e-3 * 0.1] * 2
    cfg = TrainConfig(steps=6, schedule_steps=4, batch=2, seq=8, warmup=1)
    tr = Trainer(exe, cfg)
    data = ByteBatches(read_bytes(), cfg.batch, cfg.seq, seed=0)
    assert [tr.train_step(data.batch_at(i)).loss for i in range(6)] == losses
    rc, _, err = run_cli(capsys, "train", "--resume", str(run), "--steps", "5")
    assert rc == 2 and "--steps 5 is below the checkpoint's steps=6" in err, err
    rc, _, err = run_cli(capsys, "train", "--resume", str(run), "--steps", "8", "--lr", "0.01")
    assert rc == 2 and "--lr 0.01 differs from the checkpoint's lr=0.003" in err, err
