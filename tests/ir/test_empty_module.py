"""A module without functions: its text round-trips through print and parse; ``k3ir print`` prints it, while
``compile -o`` and ``train`` refuse it with one line naming what is missing (``--ir-only`` still runs)."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli
from helpers import write_file

import k3ir


@pytest.mark.parametrize("src", ['module @"x" {} {\n}\n', "module @x {\n}\n", "module @x {} {\n  param @p: f32[2]\n}\n",
                                 "module @x {a=1} {\n}\n"])
def test_empty_module_round_trip(src):
    m = k3ir.parse_module(src)
    text = k3ir.print_module(m)
    m2 = k3ir.parse_module(text)
    assert k3ir.print_module(m2) == text and m2.attrs == m.attrs and list(m2.params) == list(m.params)
    assert m2.functions == {}


def test_empty_module_commands(capsys, tmp_path):
    src = write_file(tmp_path, "emptymod.k3", 'module @"x" {} {\n}\n')
    rc, out, err = run_cli(capsys, "print", src)
    assert rc == 0 and out == "module @x {\n}\n"
    again = write_file(tmp_path, "e2.k3", out)
    assert run_cli(capsys, "print", again)[:2] == (0, out)
    art = tmp_path / "em_t"
    rc, _, err = run_cli(capsys, "compile", src, "--target", "torch", "-o", str(art))
    assert rc == 2 and one_line_error(err) == (
        f"k3ir: error: {src}: nothing to build: an artifact needs @forward or @prefill (the module has no "
        "functions); --ir-only runs the pipeline without building")
    assert not (art / "manifest.json").exists()
    rc, _, err = run_cli(capsys, "compile", src, "--target", "torch", "--ir-only")
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "train", src, "--steps", "1", "--out", str(tmp_path / "tr"))
    assert rc == 2 and one_line_error(err) == "k3ir: error: module has no @forward function to train"
