"""Compute dtypes per target: each target's supported dtypes are checked before anything is loaded or built
(``k3ir.compile``, ``k3ir compile``, ``k3ir generate``), errors name the target and what it supports (exit 2 on the
CLI), aliases resolve to canonical names, and the reference target computes in float64 only."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported: triton usable on CPU
from conftest import one_line_error, run_cli
from k3ir.backends import DTYPES, get_backend, list_backends
from k3ir.runtime import Session

import k3ir
from k3ir.errors import K3BackendError


def test_cli_compile_rejects_float8_before_loading(capsys):
    """The dtype check precedes loading: a model path that does not exist is never reached."""
    rc, _, err = run_cli(capsys, "compile", "no/such/model.json", "--target", "triton", "--dtype", "float8")
    assert rc == 2
    err = one_line_error(err)
    assert "float8" in err and "'triton'" in err and "no/such" not in err
    for ok in ("float32", "bfloat16", "float16", "float64"):      # the Triton executable takes all four
        assert ok in err


def test_generate_checks_dtype_before_loading(capsys):
    rc, _, err = run_cli(capsys, "generate", "no/such/model.json", "--prompt", "x", "--target", "onnx",
                         "--dtype", "bfloat16")
    assert rc == 2
    assert "unsupported dtype 'bfloat16' for target 'onnx' (supported: float32, float16)" in one_line_error(err)


def test_python_compile_rejects_dtype_even_where_target_cannot_run(monkeypatch):
    """On a CPU machine without TRITON_INTERPRET the triton target is unavailable; a bad dtype is
    still reported as the dtype error, not as the unavailable target."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = k3ir.load("k3-tiny")
    with pytest.raises(K3BackendError, match=r"unknown dtype 'float8' for target 'triton' \(supported: float32"):
        k3ir.compile(m, target="triton", dtype="float8")


@pytest.mark.parametrize("target,bad,supported", [("mlir", "float16", "float32"),
                                                  ("onnx", "bfloat16", "float32, float16"),
                                                  ("tvm", "bf16", "float32, float64")])
def test_unsupported_dtype_names_the_target_dtypes(capsys, target, bad, supported):
    """These executables compute only in ``supported`` (their constructors reject the rest; none rounds a
    dtype up silently): the error comes first, on any machine, at exit 2."""
    with pytest.raises(K3BackendError) as e:
        k3ir.compile(k3ir.load("k3-tiny"), target=target, dtype=bad)
    assert str(e.value) == f"unsupported dtype '{bad}' for target '{target}' (supported: {supported})"
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", target, "--dtype", bad, "--no-build")
    assert rc == 2 and f"unsupported dtype '{bad}'" in one_line_error(err)


def test_declared_dtypes_build_and_aliases_resolve():
    """Every dtype a usable target declares builds there (the executable records it), aliases
    resolve to the canonical name, and the reference target computes in float64 whatever is asked."""
    m = k3ir.load("k3-tiny")
    for b in list_backends():
        if b.available() is not None or b.name not in ("torch", "triton", "reference"):
            continue
        for dt in b.dtypes or DTYPES:
            exe = k3ir.compile(m, target=b.name, dtype=dt)
            assert exe.dtype == ("float64" if b.name == "reference" else dt), (b.name, dt)
    assert k3ir.compile(m, target="torch", dtype="bf16").dtype == "bfloat16"
    assert get_backend("mlir").dtypes == ("float32",)


def test_compile_accepts_torch_dtype():
    m = k3ir.load("k3-tiny")
    assert k3ir.compile(m, target="torch", dtype=torch.float64).dtype == "float64"
    with pytest.raises(K3BackendError, match=r"unknown dtype 'int32' for target 'torch'"):
        k3ir.compile(m, target="torch", dtype=torch.int32)


# ---- the reference target computes in float64 only --------------------------------------------------------
def test_reference_rejects_float32_python_and_cli(capsys):
    m = k3ir.load("k3-tiny")
    with pytest.raises(K3BackendError) as e:
        k3ir.compile(m, target="reference", dtype="float32")
    msg = str(e.value)
    assert msg.startswith("unsupported dtype 'float32' for target 'reference' (supported: float64)"), msg
    assert "target 'torch'" in msg
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "reference", "--dtype", "float32", "--no-build")
    assert rc == 2 and "supported: float64" in one_line_error(err)
    rc, _, err = run_cli(capsys, "compile", "k3-tiny", "--target", "reference", "--dtype", "bf16", "--no-build")
    assert rc == 2 and "unsupported dtype 'bf16'" in one_line_error(err)


def test_reference_default_and_float64_compute_in_float64():
    m = k3ir.load("k3-tiny")
    for dt in (None, "float64", "f64"):
        exe = k3ir.compile(m, target="reference", dtype=dt) if dt else k3ir.compile(m, target="reference")
        assert exe.dtype == "float64"
    ids = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
    ref = Session(k3ir.compile(m, target="reference"), seed=0).forward(ids)
    tor = Session(k3ir.compile(m, target="torch", dtype="float64"), seed=0).forward(ids)
    ref = np.asarray(ref)
    assert ref.dtype == np.float64
    assert np.abs(ref - tor.numpy()).max() <= 1e-9 * max(1.0, np.abs(ref).max())   # same math, both float64
    assert k3ir.compile(m, target="torch").dtype == "float32"            # other targets keep float32
