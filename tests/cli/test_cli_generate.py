"""``k3ir generate`` as a new user meets it: the random-weights warning (once, on stderr), a ``k3ir train`` run
or its ``checkpoints/step-N`` as MODEL, control characters escaped unless ``--raw``; and ``k3ir print -``
(text IR on standard input)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import run_cli
from k3ir.cli.generate import escape_controls

WARNING = "has no trained weights"
GEN = ("--max-tokens", "3", "--threads", "1", "--show-ids")


def test_escape_controls_hand_cases():
    assert escape_controls("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert escape_controls("\x00\x07\x08\r\x7f\x9b") == "\\x00\\x07\\x08\\x0d\\x7f\\x9b"
    assert escape_controls("line\n\ttab é 你好 \\x41") == "line\n\ttab é 你好 \\x41"     # kept as they are


def test_generate_bundled_model_warns_once_and_escapes_controls(capsys):
    rc, out, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "K\x1b]0;title\x07", *GEN)
    assert rc == 0, err
    assert err.count(WARNING) == 1 and len(err.splitlines()) == 1, err
    assert "RUN/checkpoints/step-N" in err and "random init (seed 0)" in err
    assert out.startswith("K\\x1b]0;title\\x07") and "\x1b" not in out and "\x07" not in out
    rc, raw, _ = run_cli(capsys, "generate", "k3-tiny", "--prompt", "K\x1b]0;title\x07", *GEN, "--raw")
    assert rc == 0 and raw.startswith("K\x1b]0;title\x07")
    assert raw.split("token ids: ")[1] == out.split("token ids: ")[1]           # same tokens, only the display differs


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """A one-step ``k3ir train`` run directory (k3-tiny)."""
    from k3ir.cli import main
    run = tmp_path_factory.mktemp("gen") / "run"
    assert main(["train", "k3-tiny", "--steps", "1", "--batch", "1", "--seq", "8", "--threads", "1", "--no-plot",
                 "--out", str(run)]) == 0
    return run


def test_generate_from_a_train_checkpoint_and_its_run(capsys, train_run):
    step = train_run / "checkpoints" / "step-000001"
    rc, out, err = run_cli(capsys, "generate", str(step), "--prompt", "Ki", *GEN)
    assert rc == 0 and err == "", err                                              # trained weights: no warning
    ids = out.split("token ids: ")[1]
    rc, out_run, err = run_cli(capsys, "generate", str(train_run), "--prompt", "Ki", *GEN)
    assert rc == 0 and err == f"k3ir: note: {train_run} is a training run; using its latest checkpoint {step}"
    assert out_run.split("token ids: ")[1] == ids
    rc, out_tiny, _ = run_cli(capsys, "generate", "k3-tiny", "--prompt", "Ki", *GEN)
    assert out_tiny.split("token ids: ")[1] != ids                                # the trained weights were used


def _k3(*args, stdin=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "k3ir.cli", *args], input=stdin, capture_output=True,
                          env=env, timeout=300, check=False)


@pytest.mark.parametrize("model", ["k3-tiny", "kimi-k3"])
def test_print_reads_standard_input(tmp_path, model):
    a = _k3("print", model)
    assert a.returncode == 0, a.stderr
    (tmp_path / "a.k3").write_bytes(a.stdout)
    b = _k3("print", str(tmp_path / "a.k3"))
    c = _k3("print", "-", stdin=a.stdout)
    assert b.returncode == 0 and c.returncode == 0, c.stderr
    assert b.stdout == a.stdout and c.stdout == a.stdout


def test_print_standard_input_errors_name_stdin():
    p = _k3("print", "-", stdin=b'module @m {\n  func @f() -> () {\n    %y: f32[2] = k3.nosuchop()\n')
    err = p.stderr.decode()
    assert p.returncode == 2 and err.startswith("k3ir: error: <stdin>:3:") and len(err.splitlines()) == 1, err
    p = _k3("print", "-", "--set", "hidden_size=8", stdin=b"")
    assert p.returncode == 2 and "--set does not apply" in p.stderr.decode()
