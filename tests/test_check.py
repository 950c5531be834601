"""``k3ir check``: ops a target lowers natively vs by decomposition, decided before compiling."""
from __future__ import annotations

import json

import pytest
from k3ir.backends.check import DECOMPOSED, ERROR, NATIVE, check_module
from k3ir.runtime.cli import main

import k3ir


def test_k3_on_tvm_llvm_has_no_unexplained_ops(capsys):
    pytest.importorskip("tvm")
    assert main(["check", "kimi-k3", "--target", "tvm-llvm"]) == 0
    out = capsys.readouterr().out
    assert "0 with neither" in out
    for op in ("k3.fused_kda", "k3.grouped_matmul", "k3.moe_dispatch", "k3.mla", "k3.attn_res_fused"):
        assert op in out
    assert main(["check", "kimi-k3", "--target", "tvm-llvm", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ops"]
    from k3ir.backends import get_backend
    native = get_backend("tvm").lowers()
    status = {r["op"]: r["status"] for r in rows}
    assert status["k3.fused_kda"] == NATIVE and status["k3.grouped_matmul"] == NATIVE   # MXFP4 experts
    assert status["k3.layernorm"] == DECOMPOSED                  # vision tower ops fall back
    for r in rows:
        assert r["status"] in (NATIVE, DECOMPOSED), r
        assert (r["status"] == NATIVE) == (r["op"] in native)
        assert set(r["via"]) <= native                            # each expansion ends in native ops


def test_op_with_neither_is_an_error():
    """MXFP4 grouped matmul has no decomposition (bit unpacking): a target lowering only core
    ops cannot run it, and the report says why."""
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("torch"), quantize="mxfp4")
    core = {n for n, c in k3ir.opdef.all_ops().items() if c.family == "core"}
    rep = check_module(m, "core-only", native=core)
    bad = {r.op: r.why for r in rep.errors}
    assert "k3.grouped_matmul" in bad and "decomposition refused" in bad["k3.grouped_matmul"]
    assert all(r.status != ERROR for r in rep.rows if r.op == "k3.fused_kda")   # decomposes to core ops
    # with quant=none the same op decomposes into core ops
    m2 = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("torch"), quantize="none")
    rep2 = check_module(m2, "core-only", native=core)
    assert not rep2.errors
    assert {r.status for r in rep2.rows if r.op == "k3.grouped_matmul"} == {DECOMPOSED}


def test_check_unknown_target_exits_2(capsys):
    assert main(["check", "k3-tiny", "--target", "no-such-target"]) == 2
    assert "unknown target" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["onnx", "mlir"])
def test_check_classifies_only_built_functions(capsys, target):
    """ONNX/MLIR build forward/prefill/decode only: the vision functions (whose k3.rope_2d needs
    k3.rope_2d_table) are listed as not checked instead of failing the check."""
    from k3ir.backends import get_backend
    assert set(get_backend(target).functions) == {"forward", "prefill", "decode"}
    assert main(["check", "k3-tiny", "--target", target]) == 0
    out = capsys.readouterr().out
    assert "0 with neither" in out and "not checked" in out and "encode_images" in out
    assert main(["check", "k3-tiny", "--target", target, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    m = k3ir.load("k3-tiny")
    assert set(rep["skipped_functions"]) == set(m.functions) - {"forward", "prefill", "decode"}
    assert all(set(r["functions"]) <= {"forward", "prefill", "decode"} for r in rep["ops"])
    assert not any(r["status"] == ERROR for r in rep["ops"])


def test_check_every_function_by_default_and_explicit_functions():
    """A backend that does not declare functions is checked on all of them; passing the vision
    function explicitly to a core-op target still reports its op with neither lowering."""
    from k3ir.backends import get_backend
    from k3ir.backends.check import built_functions
    m = k3ir.load("k3-tiny")
    assert get_backend("reference").functions is None
    rep = check_module(m, "reference")
    assert rep.skipped == [] and not rep.errors
    assert built_functions(m, ("forward", "no-such")) == ["forward"]
    lowers = set(get_backend("onnx").lowers())
    vis = check_module(m, "onnx-like", native=lowers, functions=("encode_images",))
    assert "forward" in vis.skipped and vis.errors                # the vision ops, if built, would fail
    assert any("k3.rope_2d" in r.op or "rope_2d" in r.why for r in vis.errors)


def test_via_counts_the_native_ops_each_row_expands_to():
    """S5-13: ``via`` holds real counts (summed over the row's instances), hand-counted from the
    decompositions: linear = transpose + matmul; rmsnorm = square, reduce_mean, constant (eps),
    add, rsqrt and two muls."""
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("torch"), quantize="none")
    core = {n for n, c in k3ir.opdef.all_ops().items() if c.family == "core"}
    rows = {r["op"]: r for r in json.loads(json.dumps(check_module(m, "core-only", native=core).as_dict()))["ops"]}
    lin, rms = rows["k3.linear"], rows["k3.rmsnorm"]
    n_lin = sum(op.name == "k3.linear" for f in m.functions.values() for op in f.ops)
    n_rms = sum(op.name == "k3.rmsnorm" for f in m.functions.values() for op in f.ops)
    assert lin["count"] == n_lin > 0 and rms["count"] == n_rms > 0
    assert lin["via"] == {"k3.transpose": n_lin, "k3.matmul": n_lin}
    assert rms["via"] == {"k3.square": n_rms, "k3.reduce_mean": n_rms, "k3.constant": n_rms, "k3.add": n_rms,
                          "k3.rsqrt": n_rms, "k3.mul": 2 * n_rms}
    assert all(v >= 1 for r in rows.values() for v in r["via"].values())
