"""The ``k3ir`` command line, run as a subprocess: inspect, print round trip, user errors (exit 2,
one line, no traceback), --version, backends, and the main job ``k3ir run``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import k3ir

ENV = dict(os.environ, COLUMNS="400", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def k3(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3ir.cli", *args], check=False, capture_output=True,
                          text=True, env=ENV, cwd=cwd, timeout=600)


def assert_user_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def inspect_text():
    p = k3("inspect")
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_inspect(inspect_text):
    assert "2,779.5 B total" in inspect_text
    assert "104.2 B active" in inspect_text
    assert "69 KDA + 24 MLA" in inspect_text


def test_inspect_json():
    p = k3("inspect", "kimi-k3", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert abs(r["params_total"] / 2779.5e9 - 1) < 5e-4
    assert abs(r["params_active"] / 104.2e9 - 1) < 5e-4
    assert r["flops_per_token"] > 2 * 100e9                  # at least 2 FLOPs per active parameter
    assert len(r["layers"]) == 93
    mla = [lr["layer"] for lr in r["layers"] if lr["attention"] == "mla"]
    assert mla == [i for i in range(93) if (i + 1) % 4 == 0] + [92]


def test_print_roundtrip_k3(tmp_path):
    p = k3("print", "kimi-k3")
    assert p.returncode == 0, p.stderr
    f = tmp_path / "k3.k3"
    f.write_text(p.stdout)
    q = k3("print", str(f))
    assert q.returncode == 0, q.stderr
    assert q.stdout == p.stdout
    assert p.stdout.startswith('module @"kimi-k3"')


def test_print_broken_file(tmp_path):
    f = tmp_path / "broken.k3"
    f.write_text('module @m {\n  param @w: f32[4,3]\n  func @f(%x: f32[B,3]) -> (f32[B,4]) {\n'
                 '    %y: f32[B,4] = k3.nosuchop(%x)\n    return %y\n  }\n}\n')
    line = assert_user_error(k3("print", str(f)), f"{f}:4:20:", "unknown op")
    assert line.startswith("k3ir: error:")


def test_bad_config_names_the_key(tmp_path):
    from k3ir.frontend.config import read_config
    raw = read_config("k3-tiny")[0]
    raw["text_config"]["linear_attn_config"]["full_attn_layers"] = [0, 4, 8]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(raw))
    assert_user_error(k3("inspect", str(f)), "full_attn_layers", str(f))
    assert_user_error(k3("inspect", str(tmp_path / "missing.json")), "missing.json")


def test_set_without_equals():
    assert_user_error(k3("inspect", "k3-tiny", "--set", "foo"), "--set", "foo")


def test_set_override_applies():
    p = k3("inspect", "k3-tiny", "--json", "--set", "num_hidden_layers=5")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["layers"]) == 5


def test_version():
    p = k3("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"k3ir {k3ir.__version__}"


def test_backends():
    p = k3("backends")
    assert p.returncode == 0, p.stderr
    names = {ln.split("│")[1].strip() for ln in p.stdout.splitlines() if ln.count("│") > 2}
    assert {"reference", "torch"} <= names


def test_run_main_job():
    p = k3("run")
    assert p.returncode == 0, p.stderr
    assert "69 KDA + 24 MLA" in p.stdout and "2,779.5 B total" in p.stdout
    m = re.search(r"token ids: \[([0-9, ]+)\]", p.stdout)
    assert m, p.stdout
    new = [int(x) for x in m.group(1).split(",")]
    assert len(new) == 24
    # greedy: each printed token is (within fp32 rounding) the argmax of the float64 oracle's logits
    from k3ir.runtime import Session
    tiny = k3ir.load("k3-tiny")
    ref = Session(k3ir.compile(tiny, target="reference", dtype="float64"), seed=0)
    prompt = [tiny.attrs["bos_token_id"]] + list(b"Kimi K3 compiles ")
    seq = np.array([prompt + new], dtype=np.int64)
    logits = ref.forward(seq[:, :-1]).numpy()[0, len(prompt) - 1:]
    picked = logits[np.arange(len(new)), new]
    assert np.all(logits.max(-1) - picked <= 1e-4 * np.abs(logits).max())


def test_missing_optional_package_is_one_line_with_the_extra(tmp_path, monkeypatch, capsys):
    """A command whose optional dependency is absent names the package and the pip extra (exit 2)."""
    from k3ir.cli import main
    monkeypatch.setitem(sys.modules, "pydot", None)       # `import pydot` now raises ModuleNotFoundError
    rc = main(["export", "k3-tiny", "--format", "dot", "-o", str(tmp_path / "g.dot")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "k3ir: error: export needs the Python package 'pydot': pip install 'k3ir[pictures]'"


def test_console_keeps_square_brackets(capsys):
    """Install hints ('k3ir[tvm]') and user paths with brackets print verbatim (no rich markup)."""
    from k3ir.cli.common import console
    console().print("pip install 'k3ir[tvm]' -> br/[red]m.json")
    assert "pip install 'k3ir[tvm]' -> br/[red]m.json" in capsys.readouterr().out


def test_unknown_device_is_a_clear_error():
    from k3ir.errors import K3BackendError
    with pytest.raises(K3BackendError, match="unknown device 'tpu'"):
        k3ir.compile(k3ir.load("k3-tiny"), target="torch", device="tpu")


def test_compiled_artifact_given_as_model_says_what_it_is(tmp_path):
    from k3ir.cli import main
    assert main(["compile", "k3-tiny", "--target", "torch", "-o", str(tmp_path / "art")]) == 0
    r = subprocess.run([sys.executable, "-m", "k3ir.cli", "inspect", str(tmp_path / "art")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "compiled artifact" in r.stderr and "Traceback" not in r.stderr


def test_unknown_compile_option_is_an_error():
    from k3ir.errors import K3BackendError
    with pytest.raises(K3BackendError, match="unknown option.*quantise"):
        k3ir.compile(k3ir.load("k3-tiny"), target="torch", quantise="mxfp4")   # misspelt 'quantize'
