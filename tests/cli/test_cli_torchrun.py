"""``k3ir generate --ep/--tp/--cp 2`` started by torchrun (2 gloo processes, 1 thread each) prints the same
text and token ids as the one-process command (cli/parallel.py), and the parallel flags' one-line
refusals: a size above 1 without torchrun, a world size other than the flags' product, a size below 1.

The torchrun runs are ``python -m torch.distributed.run --nproc-per-node 2 --master-port PORT -m
k3ir.cli generate ...`` in a subprocess (its own session, killed with its workers on a timeout)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from k3ir.cli import main

BASE = ["generate", "k3-tiny", "--max-tokens", "12", "--temperature", "0", "--show-ids"]


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _run(cmd: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """``cmd`` with one thread per process and no launcher variables inherited; the whole process group
    is killed when it overruns ``timeout``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


_ONE: dict[tuple[str, str], str] = {}
SAMPLED = "--temperature 0.8 --seed 5"


def _one_process(prompt: str, sampling: str) -> str:
    if (prompt, sampling) not in _ONE:
        r = _run([sys.executable, "-m", "k3ir.cli", *BASE, "--prompt", prompt, *sampling.split(),
                  "--threads", "1"])
        assert r.returncode == 0, r.stderr[-3000:]
        _ONE[prompt, sampling] = r.stdout
    return _ONE[prompt, sampling]


# "Kimi " is 6 tokens with BOS; "Kimi K" is 7, so under cp=2 its last token goes through a decode step;
# sampled: the same seeded generator on the same gathered logits on every rank
# --ep-capacity 6: a row holds 6 tokens and a token picks distinct experts, so 6 rows per expert per source rank
# never drop one (the static send buffer is lossless at that size)
@pytest.mark.parametrize("flags,prompt,sampling", [("--ep 2", "Kimi ", ""), ("--ep 2 --ep-capacity 6", "Kimi ", ""),
                                                   ("--tp 2", "Kimi ", ""),
                                                   ("--cp 2", "Kimi ", ""), ("--cp 2", "Kimi K", ""),
                                                   ("--dp 2", "Kimi", SAMPLED)])
def test_torchrun_generate_prints_the_one_process_text(flags, prompt, sampling):
    want = _one_process(prompt, sampling)
    assert "token ids: [" in want and want.startswith(prompt)
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
              str(_free_port()), "-m", "k3ir.cli", *BASE, "--prompt", prompt, *sampling.split(),
              *flags.split()])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == want                          # rank 0 alone prints: the text and ids once, as one process
    assert r.stderr.count("has no trained weights") == 1


def test_torchrun_run_generates_the_one_process_tokens():
    """``k3ir run --cp 2``: a 5-token prompt (BOS + "Kimi"), so the sharded prefill is 4 tokens and the fifth a
    decode step (DistributedSession.prefill); rank 0 prints the steps once, with the one-process token ids."""
    args = ["run", "--prompt", "Kimi", "--max-new-tokens", "6"]
    one = _run([sys.executable, "-m", "k3ir.cli", *args])
    assert one.returncode == 0, one.stderr[-3000:]
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
              str(_free_port()), "-m", "k3ir.cli", *args, "--cp", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    ids = [line for line in one.stdout.splitlines() if "token ids:" in line]
    assert len(ids) == 1 and [line for line in r.stdout.splitlines() if "token ids:" in line] == ids
    assert r.stdout.count("1. built") == 1 and "sharded ep=1 cp=2 tp=1 dp=1" in r.stdout
    diff = float(r.stdout.split("max |diff| ")[1].split()[0])       # forward vs prefill on the mesh
    assert diff < 1e-4


def test_parallel_flag_without_torchrun_is_one_line_with_the_command(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*BASE, "--prompt", "Kimi ", "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "torchrun --nproc-per-node 2" in err and "generate" in err and "--ep 2" in err


def test_flags_product_other_than_the_world_size_names_both(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([*BASE, "--prompt", "Kimi ", "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "= 2" in err and "WORLD_SIZE=4" in err


def test_parallel_size_below_one_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*BASE, "--prompt", "Kimi ", "--tp", "0"]) == 2
    assert "--tp must be >= 1, got 0" in capsys.readouterr().err
    assert main([*BASE, "--prompt", "Kimi ", "--ep-capacity", "-1"]) == 2
    assert "--ep-capacity must be >= 0 (0: every row, lossless), got -1" in capsys.readouterr().err


def test_prompt_shorter_than_cp_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")            # as torchrun sets it; refused before the process group starts
    assert main([*BASE, "--prompt", "", "--cp", "2"]) == 2
    assert "the prompt is 1 tokens, fewer than --cp 2" in capsys.readouterr().err
