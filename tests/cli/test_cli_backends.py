"""``k3ir backends`` reports, per target, what the probes of this machine say, once and consistently: "builds the
whole model" and "runs here", each ``yes`` or ``no (why)``, the TVM kinds from their toolchain probe and the TVM
runtime's device query; no target description claims either. TVM's C++ log lines (``Unable to detect ROCm
version``) stay off stderr, and ``k3ir compile --help`` does not import TVM at all. Piped, no row is wrapped."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from k3ir.backends import list_backends


def _env() -> dict[str, str]:
    """This process's environment when the command runs (not when the module was collected: another module may set
    ``TRITON_INTERPRET`` at collection, and the probes read here in process must see what the child sees)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _k3ir(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3ir.cli", *args], capture_output=True, text=True, env=_env(),
                          check=False, timeout=300)


def _tables(stdout: str) -> dict[str, dict[str, list[str]]]:
    """title -> {first cell -> cells} of each rich table in ``stdout`` (a row per line: piped output is not
    wrapped, so a row that spans two lines would show up as a second row with an empty first cell)."""
    tables: dict[str, dict[str, list[str]]] = {}
    rows: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if line.count("│") >= 3:
            cells = [c.strip() for c in line.split("│")[1:-1]]
            rows.setdefault(cells[0], cells)
            assert cells[0], f"a row wrapped onto a second line: {line!r}"
        elif line.strip() and not line.strip()[0] in "┏┡└┃━─╇┳┻":
            rows = tables.setdefault(line.strip(), {})
    return tables


@pytest.fixture(scope="module")
def backends_run() -> subprocess.CompletedProcess:
    p = _k3ir("backends")
    assert p.returncode == 0, p.stderr
    return p


def test_backends_writes_nothing_to_stderr(backends_run):
    """The probes import TVM and make its targets (rocm's logs "Unable to detect ROCm version" from C++): stderr
    stays empty."""
    assert backends_run.stderr == ""


def test_every_target_has_one_row_in_each_table(backends_run):
    tables = _tables(backends_run.stdout)
    names = {b.name for b in list_backends()}
    assert set(tables) == {"registered targets", "on this machine (probes)"}, list(tables)
    assert set(tables["registered targets"]) - {"target"} == names
    assert set(tables["on this machine (probes)"]) - {"target"} == names


def test_rows_agree_with_the_probes(backends_run):
    """Each row's "builds the whole model" and "runs here" say what the probes say, read here directly: for the TVM
    kinds ``toolchain(kind)`` and ``runs_here(kind)``, for every other target its ``available()``."""
    status = _tables(backends_run.stdout)["on this machine (probes)"]
    gpu_kinds = set()
    if "tvm-cuda" in status:
        from k3ir.backends.tvm.cross import runs_here, toolchain, tvm_missing
        from k3ir.backends.tvm.gpu import GPU_KINDS
        gpu_kinds = {f"tvm-{k}" for k in GPU_KINDS}
        for kind in GPU_KINDS:
            _, builds, runs = status[f"tvm-{kind}"]
            why, tool = toolchain(kind)
            assert builds == (f"yes ({tool})" if why is None else f"no ({why})"), (kind, builds)
            run_why = tvm_missing() or runs_here(kind)
            assert (runs == "yes") if run_why is None else runs.startswith("no ("), (kind, runs, run_why)
        assert status["tvm-vulkan"][1].startswith("no (") and toolchain("vulkan")[0] is not None
    for b in list_backends():
        if b.name in gpu_kinds or b.name == "tvm-vulkan":
            continue
        why = b.available()
        assert status[b.name][1:] == (["yes", "yes"] if why is None else [f"no ({why})", "no (same reason)"]), b.name
    for name, (_, builds, runs) in status.items():
        if name != "target":
            assert builds.startswith(("yes", "no (")) and runs.startswith(("yes", "no (")), (name, builds, runs)


def test_descriptions_claim_nothing_about_this_machine(backends_run):
    for name, (_, _, _, description) in _tables(backends_run.stdout)["registered targets"].items():
        assert "builds here" not in description and "runs here" not in description, (name, description)


def test_compile_help_imports_no_tvm_and_prints_no_tvm_log():
    """``compile --help`` lists every target's phases without an availability probe: TVM is not imported."""
    code = ("import sys\nfrom k3ir.cli import main\ntry:\n    main(['compile', '--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=False, timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "pipelines by phase" in p.stdout and "tvm-cuda" in p.stdout
    assert p.stdout.splitlines()[-1] == "[]", p.stdout.splitlines()[-1]


def test_check_and_compile_print_no_tvm_log():
    """``check`` runs the pipeline without probing the target; ``compile`` probes it with TVM's log kept off stderr
    (tvm-rocm: making its target logs "Unable to detect ROCm version")."""
    for args in (("check", "k3-tiny", "--target", "tvm-rocm"), ("compile", "k3-tiny", "--target", "tvm-rocm",
                                                                 "--ir-only")):
        p = _k3ir(*args)
        assert p.returncode == 0 and p.stderr == "", (args, p.stderr)


def test_native_stderr_hidden_keeps_python_stderr(capfd, caplog):
    """What is written to descriptor 2 directly (as C++ libraries do) is logged at debug level, not shown; Python's
    own stderr writes in the block still are."""
    from k3ir.cli.common import native_stderr_hidden
    with caplog.at_level(logging.DEBUG, logger="k3ir.cli"), native_stderr_hidden("testing"):
        os.write(2, b"[12:00:00] target.cc:42: Warning: from native code\n")
        print("from python", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    assert "from python" in err and "native code" not in err, err
    assert any("native stderr while testing" in r.getMessage() and "from native code" in r.getMessage()
               for r in caplog.records)


def test_native_stderr_hidden_restores_descriptor_2_after_an_error(capfd):
    from k3ir.cli.common import native_stderr_hidden
    with pytest.raises(RuntimeError, match="probe failed"), native_stderr_hidden("testing"):
        raise RuntimeError("probe failed")
    os.write(2, b"after the block\n")
    assert "after the block" in capfd.readouterr().err
