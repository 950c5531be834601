"""``k3ir check``: ops a target lowers natively, conditionally or by decomposition, and the functions it
cannot build, decided before compiling and checked against what runs."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import one_line_error, rel_err, run_cli, usage_error
from k3ir.backends.check import CONDITIONAL, DECOMPOSED, ERROR, NATIVE, check_module
from k3ir.cli import main

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
    assert status["k3.merge_media"] == DECOMPOSED               # the media merge of forward_media falls back
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
    assert "argument --target: unknown target 'no-such-target'" in usage_error(capsys, "check", "k3-tiny", "--target",
                                                                                "no-such-target")


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
    """``via`` holds real counts (summed over the row's instances), hand-counted from the
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


def test_conditional_op_is_reported_with_its_reason_and_refused_at_run_time():
    """ONNX lowers ``k3.grouped_matmul`` for quant none/mxfp4 only: with INT4 experts ``check`` names the
    condition (no decomposition: an error), and the exporter refuses the op the same way."""
    pytest.importorskip("onnx")
    from k3ir.backends import get_backend
    from k3ir.backends.onnx.export import export_onnx
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for

    from k3ir.errors import K3BackendError
    m = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("torch"), quantize="int4")
    gmm = next(op for f in m.functions.values() for op in f.ops if op.name == "k3.grouped_matmul")
    assert "quant=int4 is not lowered" in get_backend("onnx").supports(gmm)
    rep = check_module(m, "onnx")
    bad = {r.op: r.why for r in rep.errors}
    assert "quant=int4 is not lowered" in bad["k3.grouped_matmul"] and "no decomposition" in bad["k3.grouped_matmul"]
    assert set(rep.failed) == {"forward", "prefill", "decode"}
    with pytest.raises(K3BackendError, match="quant=int4"):
        export_onnx(m, None, function="forward", weights="inputs")
    m2 = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("torch"), quantize="mxfp4")
    assert {r.status for r in check_module(m2, "onnx").rows if r.op == "k3.grouped_matmul"} == {NATIVE}


def _counting_backend(name: str, counts: dict):
    """A registered float64 backend: every op's reference, ``k3.linear`` native only for weights with at
    most 64 output rows (else its decomposition); ``counts['k3.linear']`` counts the native calls."""
    from k3ir.backends import Backend, register_backend
    from k3ir.backends.lowering import LoweringTable
    from k3ir.backends.reference import ReferenceExecutable, reference_table
    table = LoweringTable(reference_table())

    def narrow(op):
        n = op.operands[1].type.shape[0]
        return None if isinstance(n, int) and n <= 64 else f"weight rows {n} > 64"

    ref_linear = table["k3.linear"]

    @table.lowers("k3.linear", when=narrow)
    def linear(inst, x, w):
        counts["k3.linear"] = counts.get("k3.linear", 0) + 1
        return ref_linear(inst, x, w)

    class Exe(ReferenceExecutable):
        def __init__(self, module, dtype, device):
            super().__init__(module, dtype, device)
            self.target = name
            self.table = table
    return register_backend(Backend(name=name, description="test: conditional k3.linear", pipeline=[],
                                    build=lambda module, dtype="float64", device="cpu": Exe(module, dtype, device),
                                    table=lambda: table, dtypes=("float64",)))


def test_check_matches_what_runs_for_a_conditional_entry(monkeypatch):
    """A backend whose ``k3.linear`` is native only for narrow weights: ``check`` lists the wide instances
    as conditional (with the reason, expanded to transpose + matmul), and a run calls the native
    implementation exactly for the instances ``check`` calls native; the logits equal the reference's. The backend
    is registered for this test only (the registry is process-wide: ``k3ir backends`` is compared with it)."""
    from k3ir.runtime import Session
    from k3ir.runtime.params import init_params

    from k3ir import backends
    backends.list_backends()                                       # the built-in targets first
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    counts: dict = {}
    _counting_backend("test-conditional-linear", counts)
    m = k3ir.load("k3-tiny")
    rep = check_module(m, "test-conditional-linear", requested=["forward"])
    rows = [r for r in rep.rows if r.op == "k3.linear"]
    cond = [r for r in rows if r.status == CONDITIONAL]
    assert cond and all("> 64" in r.why and set(r.via) == {"k3.transpose", "k3.matmul"} for r in cond)
    fwd = m.functions["forward"]
    native_fwd = sum(op.name == "k3.linear" and op.operands[1].type.shape[0] <= 64 for op in fwd.ops)
    wide_fwd = sum(op.name == "k3.linear" and op.operands[1].type.shape[0] > 64 for op in fwd.ops)
    assert native_fwd > 0 and wide_fwd > 0
    params = init_params(m, seed=1)
    ids = np.array([[3, 17, 40]])
    got = Session(k3ir.compile(m, target="test-conditional-linear"), params=params).forward(ids)
    assert counts["k3.linear"] == native_fwd                      # the wide ones ran their decomposition
    want = Session(k3ir.compile(m, target="reference"), params=params).forward(ids)
    assert rel_err(np.asarray(got), np.asarray(want)) < 1e-12


def test_tvm_check_reports_the_vision_entry_points_it_cannot_lower(capsys):
    """k3-tiny's ``@encode_images`` takes ``[N, 2*MH, 2*MW, ...]``, which TVM cannot express: ``check``
    reports it unsupported with that reason (exit 0: the text entry points run); asked for with
    ``--function`` it exits 2 naming the function."""
    pytest.importorskip("tvm")
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", "tvm-llvm", "--json")
    assert rc == 0, err
    fns = {f["name"]: f for f in json.loads(out)["functions"]}
    assert fns["encode_images"]["status"] == "unsupported" and "2*MH" in fns["encode_images"]["why"]
    assert all(fns[f]["status"] == "supported" and fns[f]["requested"] for f in ("forward", "prefill", "decode"))
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", "tvm-llvm")
    assert rc == 0 and "function @encode_images unsupported" in out and "2*MH" in out
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", "tvm-llvm", "--function", "encode_images")
    assert rc == 2 and "@encode_images" in one_line_error(err) and "2*MH" in err
    from k3ir.backends.tvm.lower import build_relax  # what check says is what the lowering does

    from k3ir.errors import K3BackendError
    with pytest.raises(K3BackendError, match=r"cannot express the dimension '2\*MH'"):
        build_relax(k3ir.load("k3-tiny"), ["encode_images"])


@pytest.mark.parametrize("target", ["onnx", "mlir"])
def test_vision_functions_the_target_does_not_build_are_unsupported(capsys, target):
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", target, "--json")
    assert rc == 0, err
    fns = {f["name"]: f for f in json.loads(out)["functions"]}
    for f in ("encode_images", "forward_media", "prefill_media"):
        assert fns[f]["status"] == "unsupported" and "builds only forward, prefill, decode" in fns[f]["why"]
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", target, "--function", "forward_media")
    assert rc == 2 and "@forward_media" in one_line_error(err)


def test_check_function_flag_errors(capsys):
    rc, _, err = run_cli(capsys, "check", "k3-tiny", "--target", "torch", "--function", "no_such")
    assert rc == 2 and "--function no_such" in one_line_error(err) and "encode_images" in err
    rc, _, err = run_cli(capsys, "check", "k3-tiny", "--target", "torch", "--function", "encode_images",
                         "--function", "forward")
    assert rc == 0, err


def test_every_builtin_backend_owns_a_table_and_answers_supports():
    """reference, torch, triton, tvm, onnx, mlir: ``Backend.lowering_table()`` holds every op ``lowers()``
    names and ``supports`` agrees with it (None for a plain entry, a reason for a missing op)."""
    from k3ir.backends import get_backend
    m = k3ir.load("k3-tiny")
    ops = {op.name: op for f in m.functions.values() for op in f.ops if op.name != "k3.param"}
    for name in ("reference", "torch", "triton", "tvm", "onnx", "mlir"):
        be = get_backend(name)
        if be.available() and name != "triton":
            continue
        table = be.lowering_table()
        assert set(table) == set(be.lowers()) and table, name
        for op in ops.values():
            why = be.supports(op)
            assert (why is None) == (op.name in table) or op.name in getattr(table, "conditions", {}), (name, op.name)


def test_triton_support_table_is_what_the_executable_runs():
    """``backends/triton/support.py``: the torch table overridden by the Triton kernels and lowerings, the
    names the triton backend lowers; no op refused statically."""
    pytest.importorskip("triton")
    from k3ir.backends import get_backend
    from k3ir.backends.triton import support
    from k3ir.backends.triton.executable import KERNELS
    table = support.table()
    assert set(table) == set(get_backend("triton").lowers())
    assert all(table[n] is KERNELS[n] for n in KERNELS)
    m = k3ir.load("k3-tiny")
    assert all(support.supports(op) is None for f in m.functions.values() for op in f.ops if op.name != "k3.param")


def test_backend_pipeline_in_named_phases():
    """``Backend.phases`` is the pipeline by phase; a flat ``pipeline`` is grouped into the catalogue's phases
    (unknown passes into ``passes``); malformed phases are errors naming the backend."""
    from k3ir.backends import Backend

    from k3ir.errors import K3BackendError, K3Error
    b = Backend(name="x", description="", build=None, phases=[("fuse", ["fuse-kda-chunks"]), ("cleanup", ["dce"])])
    assert b.pipeline == ["fuse-kda-chunks", "dce"]
    flat = Backend(name="y", description="", build=None, pipeline=["fuse-attn-res", "my-pass{k=1}", "cse", "dce"])
    assert flat.phases == [("fuse", ["fuse-attn-res"]), ("passes", ["my-pass{k=1}"]), ("cleanup", ["cse", "dce"])]
    for bad, msg in (([("a b", ["dce"])], "not a word"), ([("c", ["dce"]), ("c", [])], "declared twice"),
                     ([("c", "dce")], "pair"), ("dce", "list of")):
        with pytest.raises(K3Error, match=msg) as e:
            Backend(name="z", description="", build=None, phases=bad)
        assert "backend 'z'" in str(e.value)
    with pytest.raises(K3BackendError, match="differ"):
        Backend(name="z", description="", build=None, pipeline=["cse"], phases=[("cleanup", ["dce"])])


def test_check_shows_phases_that_ran_and_the_target_description(capsys):
    """``k3ir check --target triton``: the device features the kernels rely on, the pipeline by phase with each
    pass's rewrites (fuse-kda-chunks fuses every k3.kda of the text functions it checks)."""
    pytest.importorskip("triton")
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", "triton", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    desc = rep["target_description"]
    assert desc["kind"] == "cuda" and desc["limits"] == {"shared_memory_per_block_bytes": 232448}
    assert any(f.startswith("programmatic dependent launch") for f in desc["features"])
    assert any(f.startswith("wgmma") for f in desc["features"])
    assert [p["name"] for p in rep["phases"]] == ["fuse", "quantize", "specialize", "decode", "cleanup"]
    m = k3ir.load("k3-tiny")
    kda = sum(1 for f in m.functions.values() for op in f.ops if op.name == "k3.kda")
    ran = {p["pass"]: p for p in rep["passes"]}
    assert ran["fuse-kda-chunks"]["phase"] == "fuse" and ran["fuse-kda-chunks"]["rewrites"] == kda > 0
    rc, out, err = run_cli(capsys, "check", "k3-tiny", "--target", "triton")
    assert rc == 0, err
    assert "relies on: programmatic dependent launch, wgmma" in out and "phase fuse: fuse-kda-chunks (" in out


def test_check_claims_what_the_torch_target_dispatches():
    """Every op implementation the torch executable calls during a k3-tiny forward is one ``check`` calls native
    (or a native leaf of a decomposition), and every such claim is exercised: recorded at dispatch time."""
    from collections import Counter

    from k3ir.runtime import Session
    m = k3ir.load("k3-tiny")
    exe = k3ir.compile(m, target="torch", dtype="float32")
    fwd = exe.module.clone()
    for name in [f for f in fwd.functions if f != "forward"]:
        del fwd.functions[name]
    rep = check_module(fwd, "torch")
    seen: Counter = Counter()

    def recording(name, impl):
        def run(inst, *args):
            seen[name] += 1
            return impl(inst, *args)
        return run

    exe.table = {name: recording(name, impl) for name, impl in exe.table.items()}
    Session(exe, seed=0).forward(np.random.default_rng(0).integers(0, 256, (1, 5)))
    claimed = {r.op for r in rep.rows if r.status == NATIVE} | {o for r in rep.rows if r.status != NATIVE for o in r.via}
    assert set(seen) == claimed and "k3.fused_kda" in seen


def test_compile_help_lists_each_targets_phases(capsys):
    """``k3ir compile --help`` ends with every registered target's pipeline by phase, as compile runs it."""
    from k3ir.backends import get_backend
    from k3ir.passes.pipelines import describe
    with pytest.raises(SystemExit) as e:
        main(["compile", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split(None, 1)[1] for ln in out.split("pipelines by phase")[1].splitlines()[1:] if ln}
    assert lines["triton"].startswith("fuse: fuse-kda-chunks, fuse-moe-dispatch, fuse-attn-res; quantize:")
    assert lines["onnx"] == describe(get_backend("onnx").phases) == "cleanup: dce"


def test_tvm_cross_targets_check_with_the_tvm_conditions():
    """The TVM cross targets lower with the tvm table and its conditions: the vision tower's dynamic ``2*MH``
    position table refuses ``k3.interp_weights`` there as on tvm itself."""
    pytest.importorskip("tvm")
    from k3ir.passes import run_pipeline
    from k3ir.passes.pipelines import pipeline_for
    m = run_pipeline(k3ir.load("k3-tiny"), pipeline_for("tvm"))
    rep = check_module(m, "tvm-cuda")
    assert "k3.interp_weights" in rep.functions["encode_images"] and "static dims" in rep.functions["encode_images"]
    assert not rep.failed


def test_check_refuses_mxfp4_for_webgpu_as_compile_does(capsys):
    """``check --target tvm-webgpu --quantize mxfp4``: the 8-bit expert parameters WGSL cannot hold make every built
    function unsupported, with the reason ``compile`` gives; float weights check clean."""
    pytest.importorskip("tvm")
    rc, _, err = run_cli(capsys, "check", "k3-tiny", "--target", "tvm-webgpu", "--quantize", "mxfp4")
    assert rc == 2 and "@prefill" in err and "8-bit" in err and "--quantize int4" in err
    rc, _, err = run_cli(capsys, "check", "k3-tiny", "--target", "tvm-webgpu")
    assert rc == 0, err
