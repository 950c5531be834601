"""MLIR export (linalg/tensor/func text verified by IREE's bindings) and the ``mlir`` target
(IREE llvm-cpu) against the float64 reference; offline IREE builds for other accelerators."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("iree.compiler")
pytest.importorskip("iree.runtime")

from _tiny_models import prefill_decode, route_sessions, token_ids
from conftest import rel_err
from k3ir.backends.mlir import compile_mlir, emit_mlir
from k3ir.runtime import Session

import k3ir
from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.types import TensorType


def _sessions(key: str):
    return route_sessions(key, "mlir")


def test_mlir_text_is_linalg_and_dynamic():
    m, *_ = _sessions("k3-tiny")
    text, order = emit_mlir(m, ["prefill"])
    head = next(ln for ln in text.splitlines() if "func.func @prefill" in ln)
    assert "%a0: tensor<?x?xi64>" in head                          # dynamic batch and sequence
    assert "linalg.generic" in text and "scf.for" in text            # KDA recurrence as a loop
    dialects = {ln.split("=", 1)[-1].strip().split(" ")[0].split(".")[0] for ln in text.splitlines()
                if " = " in ln and "." in ln.split("=", 1)[-1].strip().split(" ")[0]}
    assert dialects <= {"arith", "math", "linalg", "tensor", "scf"}, dialects
    assert len(order["prefill"]) == len({op.attrs["name"] for op in m.functions["prefill"].ops
                                         if op.name == "k3.param"})


def test_mlir_artifact_save_and_session_load(tmp_path):
    m, _, _, exe, sess = _sessions("k3-tiny")
    exe.save(str(tmp_path / "art"))
    man = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert man["target"] == "mlir" and (tmp_path / "art" / "k3.vmfb").stat().st_size > 0
    loaded = Session.load(str(tmp_path / "art"))
    ids = token_ids(m.attrs["vocab_size"], 1, 5)
    nxt = token_ids(m.attrs["vocab_size"], 1, 1, seed=7)
    a, b = prefill_decode(loaded, ids, nxt), prefill_decode(sess, ids, nxt)
    assert rel_err(a[0], b[0]) < 1e-6 and rel_err(a[1], b[1]) < 1e-6


def _small_module() -> Module:
    m = Module("small")
    fn = Function("forward")
    b = Builder(m, fn)
    x = b.arg("x", TensorType("f32", ("B", "T", 64)))
    y = b.linear(b.rmsnorm(x, b.param("w", TensorType("f32", (64,))), eps=1e-6),
                 b.param("lin", TensorType("f32", (32, 64))))
    b.ret(b.softmax(y, axis=-1))
    m.add_function(fn)
    return m


@pytest.mark.parametrize("target", ["rocm", "vulkan-spirv", "metal-spirv"])
def test_offline_iree_targets_build(target, tmp_path):
    from k3ir.backends.mlir.config import mlir_config
    text, _ = emit_mlir(_small_module(), ["forward"])
    with mlir_config(cache=str(tmp_path)):
        vmfb = compile_mlir(text, target)
    assert vmfb[:2] == b"PK" and b"IREE" in vmfb[:256]               # an IREE VM flatbuffer archive


def test_unknown_iree_target_is_a_clear_error():
    text, _ = emit_mlir(_small_module(), ["forward"])
    with pytest.raises(k3ir.K3BackendError, match="unknown IREE target"):
        compile_mlir(text, "tpu")
