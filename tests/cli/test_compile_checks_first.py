"""What ``k3ir compile`` refuses before it loads the model or runs a pass: a seed outside 0..2**63-1 (the range
``run``, ``generate --init-seed`` and ``train --seed`` accept) and a CUDA device on a machine without a GPU, one
line at exit 2."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_compile_refuses_out_of_range_seed(capsys, seed):
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--seed", seed)
    assert rc == 2 and out == ""                       # nothing ran: no pass table
    assert one_line_error(err) == f"k3ir: error: --seed must be >= 0 and < 2**63, got {seed}"


def test_compile_seed_bounds_match_run(capsys):
    rc, _, err = run_cli(capsys, "run", "k3-tiny", "--seed", "-1")
    assert rc == 2 and "--seed must be >= 0 and < 2**63, got -1" in one_line_error(err)
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--seed", str(2**63 - 1), "--ir-only")
    assert rc == 0, err


def test_compile_refuses_cuda_without_gpu_before_the_pipeline(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--device", "cuda")
    assert rc == 2 and out == ""                       # no pass table printed: the device was checked first
    assert one_line_error(err) == "k3ir: error: device 'cuda' requested but no CUDA GPU is available"


def test_compile_ir_only_needs_no_device(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--device", "cuda", "--ir-only")
    assert rc == 0 and "build skipped" in out, err
