"""Long builds say what they do and how long they took: ``k3ir.progress`` (a spinner on a terminal's stderr,
silent otherwise) and ``k3ir compile --target tvm|mlir`` reporting the time of the lazy build itself, per
function group, instead of the executable's construction."""
from __future__ import annotations

import io
import time

import pytest
from conftest import run_cli
from rich.console import Console

from k3ir import progress as progress_mod
from k3ir.progress import progress


def test_spinner_on_a_terminal_with_the_step_time():
    out = io.StringIO()
    t0 = time.perf_counter()
    with progress("tvm: building @forward", delay_s=0.05, console=Console(file=out, force_terminal=True)) as t:
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    assert "tvm: building @forward" in out.getvalue()
    assert 0.5 <= t.seconds <= wall


def test_silent_when_not_a_terminal_quick_or_nested():
    pipe = io.StringIO()
    with progress("piped", delay_s=0.0, console=Console(file=pipe, force_terminal=False)):
        time.sleep(0.2)
    assert pipe.getvalue() == ""
    term = io.StringIO()
    with progress("quick", delay_s=5.0, console=Console(file=term, force_terminal=True)) as t:
        pass
    assert term.getvalue() == "" and t.seconds < 5.0
    outer, inner = io.StringIO(), io.StringIO()
    with progress("outer", delay_s=0.0, console=Console(file=outer, force_terminal=True)), \
            progress("inner", delay_s=0.0, console=Console(file=inner, force_terminal=True)) as t:
        time.sleep(0.3)
    assert "outer" in outer.getvalue() and inner.getvalue() == "" and t.seconds >= 0.3


SLOW = 0.6        # seconds each faked function-group build takes


@pytest.fixture
def slow_tvm_build(monkeypatch):
    """The tvm backend with its lowering taking SLOW seconds and no LLVM work (fake VM), on an empty cache."""
    tvm = pytest.importorskip("tvm")
    from k3ir.backends import tvm as tb
    from k3ir.backends.tvm import lower
    from tvm.runtime import vm as runtime_vm

    def build_relax(module, group, dtype):
        time.sleep(SLOW)
        return "relax module", {f: [] for f in group}
    monkeypatch.setattr(tb, "_COMPILED", {})
    monkeypatch.setattr(lower, "build_relax", build_relax)
    monkeypatch.setattr(tvm, "compile", lambda mod, target=None: "vm executable")
    monkeypatch.setattr(runtime_vm, "VirtualMachine", lambda ex, dev, **kw: {"forward": 1, "prefill": 2, "decode": 3})


@pytest.fixture
def slow_iree_build(monkeypatch):
    """The mlir backend with MLIR emission taking SLOW seconds and no IREE work."""
    pytest.importorskip("iree.runtime")
    from k3ir.backends import mlir as mb

    def emit_mlir(module, group, weights=None, param_form=None):
        time.sleep(SLOW)
        return "module {}", {f: [] for f in group}
    monkeypatch.setattr(mb, "emit_mlir", emit_mlir)
    monkeypatch.setattr(mb, "compile_mlir", lambda text, target, data_tiling=None: b"vmfb")


@pytest.mark.parametrize("target, build", [("tvm", "slow_tvm_build"), ("mlir", "slow_iree_build")])
def test_compile_reports_the_lazy_build_time(capsys, monkeypatch, request, target, build):
    request.getfixturevalue(build)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")                 # stderr counts as a terminal: the spinner shows
    monkeypatch.setattr(progress_mod, "DEFAULT_DELAY_S", 0.05)
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", target)
    assert rc == 0, err
    line = " ".join(out[out.index("built <"):].split())                 # rich wraps long lines
    total = float(line.split(" in ")[1].split(" s")[0])
    groups = {g: float(s) for g, s in (x.strip("@").split() for x in
                                       line.split(" s (")[1].split(")")[0].replace(" s", "").split(", "))}
    # mlir: prefill and decode in modules of their own under MlirConfig.data_tiling (the default)
    assert set(groups) == ({"forward", "prefill+decode"} if target == "tvm" else {"forward", "prefill", "decode"}), line
    assert all(s >= SLOW for s in groups.values()) and total >= sum(groups.values()) >= 2 * SLOW, line
    assert "building @prefill @decode" in err or "compiling @prefill" in err, err
