"""Pass pipeline strings (``--passes``, ``run_pipeline``, ``make_pass``): option errors name the pass, the option
and the accepted range; an empty item in the list is an error; valid options reach the rewritten ops."""
from __future__ import annotations

import pytest
from conftest import one_line_error, run_cli
from k3ir.passes import run_pipeline
from k3ir.passes.manager import make_pass

import k3ir
from k3ir.errors import K3Error


@pytest.mark.parametrize("passes,msg", [
    ("fuse-moe-dispatch{capacity=-1}", ("pass 'fuse-moe-dispatch' option 'capacity': must be >= 0 (0: no fixed "
                                       "capacity), got -1")),
    ("fuse-moe-dispatch{capacity_factor=-0.5}", ("pass 'fuse-moe-dispatch' option 'capacity_factor': must be a "
                                                "finite number >= 0 (0: no static capacity), got -0.5")),
    ("fuse-moe-dispatch{capacity_factor=nan}", ("pass 'fuse-moe-dispatch' option 'capacity_factor': must be a "
                                               "finite number >= 0 (0: no static capacity), got nan")),
    ("dce,,cse", "pass list item 2 is empty (a doubled or trailing comma?)"),
    ("dce,", "pass list item 2 is empty (a doubled or trailing comma?)"),
])
def test_pass_option_errors(capsys, passes, msg):
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--passes", passes)
    assert rc == 2 and out == ""
    assert one_line_error(err) == f"k3ir: error: {msg}"


def test_pass_options_valid_still_run():
    m = run_pipeline(k3ir.load("k3-tiny"), "fuse-moe-dispatch{capacity=0,capacity_factor=1.25}, dce")
    ops = [op for op in m.functions["forward"].ops if op.name == "k3.moe_dispatch"]
    assert ops and all(op.attrs["capacity_factor"] == 1.25 for op in ops)


def test_fuse_kda_chunk_size_checked_naming_the_option(capsys):
    for bad in (0, -3, 24):
        rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--no-build",
                             "--passes", f"fuse-kda-chunks{{chunk_size={bad}}},dce")
        assert rc == 2, err
        line = one_line_error(err)
        assert "pass 'fuse-kda-chunks' option 'chunk_size'" in line and f"got {bad}" in line, line
        assert "positive multiple of 16" in line, line
    with pytest.raises(K3Error, match="option 'mode': must be auto, chunk or recurrent, got 'fast'"):
        make_pass("fuse-kda-chunks{mode=fast}")
    assert make_pass("fuse-kda-chunks{chunk_size=48}").chunk_size == 48
    assert make_pass("fuse-kda-chunks").chunk_size == 0            # default: each layer keeps its own
