"""What ``k3ir compile`` refuses before it loads the model or runs a pass: a seed outside 0..2**63-1 (the range
``run``, ``generate --init-seed`` and ``train --seed`` accept), one line at exit 2."""
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
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--seed", str(2**63 - 1), "--ir-only")
    assert rc == 0, err
