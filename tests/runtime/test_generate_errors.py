"""``k3ir generate`` options checked before any work (``--threads``, ``--block-size``, ``--max-tokens``, and
``k3ir run --max-new-tokens``; a bundled name, which has no tokenizer), and ends of generation that are not the model's: a reader that goes away
(``generate | head``: no traceback, generation stops at the first broken pipe) and Ctrl-C (exit 130, the text
line ended)."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import one_line_error, run_cli
from k3ir.cli import main

from k3ir.errors import K3ConfigError


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



def test_max_tokens_past_the_pool_says_the_largest_allowed(capsys):
    """A ``--max-tokens`` the pool cannot hold: one line in tokens, with the largest value that fits this prompt
    (pool of ``--num-blocks`` x ``--block-size`` tokens; the byte-level prompt "x" is 2 ids with BOS)."""
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--max-tokens", "100000000",
                         "--block-size", "64", "--num-blocks", "4")
    assert "Traceback" not in err
    line = one_line_error(err.splitlines()[-1])           # after the random-weights warning
    assert rc == 2 and "do not fit the pool of 256 tokens (4 blocks of 64)" in line
    assert "max_tokens can be at most 254 for this prompt" in line

# ---- a reader that goes away: generate | head ---------------------------------------------------------------
class _ClosedAfter:
    """A stdout whose reader goes away after ``n`` writes (each later write raises EPIPE)."""

    def __init__(self, n: int):
        self.n, self.writes, self.failed = n, 0, 0

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes > self.n:
            self.failed += 1
            raise BrokenPipeError(32, "Broken pipe")
        return len(s)

    def flush(self) -> None:
        pass


def test_generate_stops_at_the_first_broken_pipe(capsys, caplog, monkeypatch):
    fake = _ClosedAfter(3)                       # the prompt and two tokens, then the pipe breaks
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", fake)
    rc = main(["generate", "k3-tiny", "--prompt", "x", "--max-tokens", "40", "--threads", "1"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 0 and [ln for ln in err.splitlines() if "no trained weights" not in ln] == []
    assert fake.failed == 1, fake.failed        # no write after the first EPIPE: generation stopped there
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def test_generate_into_head_is_quiet():
    env = dict(os.environ, PYTHONUNBUFFERED="0")
    p = subprocess.Popen([sys.executable, "-m", "k3ir.cli", "generate", "k3-tiny", "--prompt", "x",
                          "--max-tokens", "200", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.read(1)                             # like `head -c 1`: read, then go away
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert rc == 0, (rc, err)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_generate_interrupt_ends_the_text_line(capsys, monkeypatch):
    from k3ir.runtime.engine import Engine

    def interrupted(self, requests=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(Engine, "run", interrupted)
    rc, out, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "Kimi ", "--max-tokens", "4")
    assert rc == 130 and err.splitlines()[-1] == "k3ir: interrupted" and len(err.splitlines()) == 2   # + the note
    assert out == "Kimi \n"                      # the message starts a line of its own on a terminal


# ---- sizes checked before any work ---------------------------------------------------------------------------
def test_generate_block_size_zero(capsys):
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--block-size", "0")
    assert rc == 2 and "--block-size must be a positive multiple" in one_line_error(err)


def test_run_max_new_tokens_zero_is_an_error_like_generate(capsys):
    rc, _, err = run_cli(capsys, "run", "--max-new-tokens", "0")
    assert rc == 2 and one_line_error(err) == "k3ir: error: --max-new-tokens must be >= 1, got 0"
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--max-tokens", "0")
    assert rc == 2 and "must be an integer >= 1, got 0" in one_line_error(err)


def test_generate_bundled_name_without_tokenizer(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "kimi-k3", "--prompt", "x", "--max-tokens", "2")
    assert rc == 2, err
    line = one_line_error(err)
    assert "'kimi-k3': it is a bundled config without a tokenizer" in line, line
    assert "checkpoint directory" in line and "tokenizer.json" in line and "put tokenizer.json" not in line, line
    from k3ir.runtime.tokenizer import load_tokenizer
    (tmp_path / "config.json").write_text("{}")          # a directory: the hint names it
    with pytest.raises(K3ConfigError, match=f"put tokenizer.json or tiktoken.model in {tmp_path}"):
        load_tokenizer(str(tmp_path), SimpleNamespace(attrs={"vocab_size": 1000}))
