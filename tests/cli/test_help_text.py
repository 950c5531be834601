"""Every option of every ``k3ir`` subcommand has a help string, and those with a default value say it, as
docs/cli.md does (``run``'s --target torch, --max-new-tokens 24, ...)."""
from __future__ import annotations

import argparse

import pytest
from k3ir.cli.app import build_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_option_has_help():
    missing = {name: [a.option_strings[-1] for a in sp._actions
                      if a.option_strings and not a.help and not isinstance(a, argparse._HelpAction)]
               for name, sp in _subcommands().items()}
    assert {k: v for k, v in missing.items() if v} == {}


@pytest.mark.parametrize("command, flag, default", [
    ("run", "--target", "torch"), ("run", "--device", "cpu"), ("run", "--prompt", "Kimi K3 compiles "),
    ("run", "--max-new-tokens", "24"), ("run", "--seed", "0"), ("compile", "--device", "cpu"),
    ("serve", "--max-output-tokens", "1024")])
def test_help_states_the_default(command, flag, default):
    action = next(a for a in _subcommands()[command]._actions if flag in a.option_strings)
    assert str(action.default) == default and default in (action.help or ""), (flag, action.help)
