"""``k3ir generate`` options checked before any work, and ends of generation that are not errors of the model:
``--threads``."""
from __future__ import annotations

import torch
from conftest import run_cli


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
