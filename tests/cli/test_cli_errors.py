"""CLI input errors that argparse or the file readers catch: a binary file where text is expected, an unusable
``--device``, a value a flag's type or choices refuse, an unknown flag; each is exit 2 with one line and no
traceback. Parse errors name the subcommand that received the argument: ``k3ir CMD: error: argument FLAG: ...;
see 'k3ir CMD --help'``, without argparse's usage block."""
from __future__ import annotations

import argparse

import pytest
from conftest import usage_error
from k3ir.cli import main
from k3ir.cli.app import build_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def _first_option(parser: argparse.ArgumentParser, want) -> str | None:
    return next((a.option_strings[-1] for a in parser._actions if a.option_strings and want(a)), None)


COMMANDS = sorted(_subcommands())
INT_FLAGS = [(c, f) for c in COMMANDS if (f := _first_option(_subcommands()[c], lambda a: a.type is int))]
CHOICE_FLAGS = [(c, f) for c in COMMANDS if (f := _first_option(_subcommands()[c], lambda a: a.choices))]


def test_every_command_is_covered():
    """The parametrisations below reach each subcommand: the unknown flag all of them, a non-integer most."""
    assert {"inspect", "print", "backends", "run", "compile", "check", "export", "train", "generate", "serve", "plan",
            "ops"} <= set(COMMANDS)
    assert {"run", "compile", "train", "generate", "serve", "plan"} <= {c for c, _ in INT_FLAGS}
    assert {"inspect", "compile", "export", "train"} <= {c for c, _ in CHOICE_FLAGS}


@pytest.mark.parametrize("command, flag", INT_FLAGS)
def test_non_integer_is_one_line_naming_the_command_and_flag(capsys, command, flag):
    line = usage_error(capsys, command, flag, "x")
    assert line == f"k3ir {command}: error: argument {flag}: invalid int value: 'x'; see 'k3ir {command} --help'"


@pytest.mark.parametrize("command, flag", CHOICE_FLAGS)
def test_bad_choice_is_one_line_naming_the_command_and_flag(capsys, command, flag):
    line = usage_error(capsys, command, flag, "zzz")
    assert line.startswith(f"k3ir {command}: error: argument {flag}: invalid choice: 'zzz' (choose from "), line
    assert line.endswith(f"; see 'k3ir {command} --help'"), line


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """The flags ``parser`` requires, each with a placeholder value (so the error shown is the one under test)."""
    return [x for a in parser._actions if a.required and a.option_strings
            for x in (a.option_strings[-1], "1" if a.type is int else "torch" if "--target" in a.option_strings else "x")]


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_flag_is_reported_by_the_command_that_got_it(capsys, command):
    line = usage_error(capsys, command, *_required(_subcommands()[command]), "--no-such-flag")
    assert line == f"k3ir {command}: error: unrecognized arguments: --no-such-flag; see 'k3ir {command} --help'"


def test_top_level_errors_name_k3ir(capsys):
    assert usage_error(capsys, "--no-such-flag") == ("k3ir: error: unrecognized arguments: --no-such-flag; "
                                                     "see 'k3ir --help'")
    line = usage_error(capsys, "compiel")
    assert line.startswith("k3ir: error: argument COMMAND: invalid choice: 'compiel' (choose from 'inspect', "), line


def test_missing_value_and_required_flag(capsys):
    assert usage_error(capsys, "compile", "k3-tiny", "--target") == ("k3ir compile: error: argument --target: "
                                                                     "expected one argument; see 'k3ir compile --help'")
    assert usage_error(capsys, "check", "k3-tiny") == ("k3ir check: error: the following arguments are required: "
                                                       "--target; see 'k3ir check --help'")


def test_help_keeps_the_usage_block(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: k3ir run [-h]") and "--max-new-tokens" in out


def test_binary_file_is_one_line_error(tmp_path, capsys):
    """A binary file where a config / IR file is expected: exit 2 and one line naming the file and where its
    first byte that is not UTF-8 sits, no UnicodeDecodeError traceback."""
    f = tmp_path / "rnd.bin"
    f.write_bytes(bytes(range(200, 256)) * 4)
    assert main(["print", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "not valid UTF-8 at line 1, column 1 (byte 0xc8" in err[0], err


@pytest.mark.parametrize("device, words", [("tpu", "unknown device 'tpu'"), ("mps", "device 'mps' is not supported"),
                                           ("CPU", "unknown device 'CPU'"), ("meta", "device 'meta' is not supported")])
def test_unusable_device_is_a_usage_error_before_any_work(capsys, device, words):
    """``--device`` tpu/mps/meta/CPU: exit 2 with one line from argparse, before any pass runs (no torch
    traceback)."""
    line = usage_error(capsys, "compile", "k3-tiny", "--target", "torch", "--device", device)
    assert line.startswith(f"k3ir compile: error: argument --device: {words}"), line


TARGET_COMMANDS = [c for c in COMMANDS if _first_option(_subcommands()[c], lambda a: "--target" in a.option_strings)]


@pytest.mark.parametrize("command", TARGET_COMMANDS)
def test_unknown_target_is_a_usage_error_before_any_work(capsys, command):
    """``--target nosuch``: exit 2 with argparse's one line naming the command, the value and the registered
    targets, and nothing on stdout (``run`` printed the Kimi K3 summary before refusing it)."""
    from k3ir.backends import list_backends
    assert {"run", "compile", "check", "serve", "inspect"} <= set(TARGET_COMMANDS)
    registered = ", ".join(sorted(b.name for b in list_backends()))
    args = ["k3-tiny"] if command != "serve" else []
    line = usage_error(capsys, command, *args, "--target", "nosuch")
    assert line == (f"k3ir {command}: error: argument --target: unknown target 'nosuch' (registered: {registered}); "
                    f"see 'k3ir {command} --help'")


def test_misspelt_target_names_the_near_one(capsys):
    line = usage_error(capsys, "run", "--target", "troch")
    assert line.startswith("k3ir run: error: argument --target: unknown target 'troch'") and "did you mean 'torch'?" in line
    line = usage_error(capsys, "compile", "k3-tiny", "--target", "cuda", "--no-build")
    assert "'cuda' is a device, not a target: use target torch or triton with device 'cuda'" in line


def test_run_refuses_a_target_that_cannot_run_here_before_any_work(capsys, monkeypatch):
    """``run --target T`` where T is registered but cannot run here (a missing pip extra, no GPU): exit 2 and one
    line naming the flag and the reason, nothing on stdout (it printed the Kimi K3 summary and built first)."""
    from conftest import one_line_error, run_cli
    from k3ir.backends import get_backend
    monkeypatch.setattr(get_backend("tvm"), "available", lambda: "apache-tvm is not installed (pip install 'k3ir[tvm]')")
    rc, stdout, err = run_cli(capsys, "run", "--target", "tvm")
    assert rc == 2 and stdout == ""
    assert one_line_error(err) == "k3ir: error: --target tvm: apache-tvm is not installed (pip install 'k3ir[tvm]')"
