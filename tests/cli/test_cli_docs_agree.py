"""docs/cli.md and the CLI agree where they drifted apart: every command with ``--ep-capacity`` documents it in
its own section; ``k3ir plan``'s no-fit message counts one GPU in the singular."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from conftest import one_line_error, run_cli
from k3ir.cli.app import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _section(command: str) -> str:
    text = DOCS.read_text()
    m = re.search(rf"^## `{command}`.*?(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert m, command
    return m.group(0)


def test_ep_capacity_is_documented_for_every_command_that_takes_it():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    takes = sorted(n for n, sp in sub.items() if any("--ep-capacity" in a.option_strings for a in sp._actions))
    assert {"run", "generate", "serve", "train"} <= set(takes)
    assert [n for n in takes if "--ep-capacity" not in _section(n)] == []


@pytest.mark.parametrize("gpus, words", [(1, "1 GPU holds 0.14 TB"), (2, "2 GPUs hold 0.28 TB")])
def test_plan_no_fit_counts_gpus_in_words(capsys, gpus, words):
    rc, _, err = run_cli(capsys, "plan", "kimi-k3", "--gpus", str(gpus))     # 141 GB per h200
    assert rc != 0 and words in one_line_error(err), err
