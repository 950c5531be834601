"""Pass manager, golden IR per pass (tests/passes/golden/<pass>/), the full K3 graph through the
triton pipeline, and the ``k3ir compile`` / ``inspect --after-passes`` commands."""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from k3ir.passes import run_pipeline
from k3ir.passes.manager import PassResult, make_pass, split_specs
from k3ir.passes.pipelines import PIPELINES, pipeline_for

import k3ir
from k3ir.errors import K3Error

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
CASES = sorted(d for d in os.listdir(GOLDEN) if os.path.isdir(os.path.join(GOLDEN, d)))


def _read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read()


# ---- manager ---------------------------------------------------------------------------------
def test_spec_parsing_and_options():
    assert split_specs("a,b{x=1,y=2},c") == ["a", "b{x=1,y=2}", "c"]
    p = make_pass("fuse-kda-chunks{chunk_size=32}")
    assert p.name == "fuse-kda-chunks" and p.chunk_size == 32 and p.spec() == "fuse-kda-chunks{chunk_size=32}"
    q = make_pass("fuse-moe-dispatch{capacity_factor=1.5, capacity=8}")
    assert q.capacity_factor == 1.5 and q.capacity == 8
    assert make_pass("absorb-mla{all_functions=true}").all_functions is True
    with pytest.raises(K3Error, match="unknown pass 'nope'"):
        make_pass("nope")
    with pytest.raises(K3Error, match="no option 'chunk'"):
        make_pass("fuse-kda-chunks{chunk=3}")
    with pytest.raises(K3Error, match="cannot read 'x' as int"):
        make_pass("fuse-kda-chunks{chunk_size=x}")


def test_pipelines_per_target():
    for t in ("reference", "torch", "triton", "tvm", "onnx", "mlir"):
        assert t in PIPELINES and all(make_pass(p) for p in PIPELINES[t])
    assert pipeline_for("tvm-cuda") == PIPELINES["tvm"]
    assert pipeline_for("triton", phases=["fuse"]) == ["fuse-kda-chunks", "fuse-moe-dispatch", "fuse-attn-res"]
    from k3ir.backends import get_backend
    from k3ir.passes.pipelines import phases_for
    assert get_backend("torch").pipeline == PIPELINES["torch"]
    assert get_backend("torch").phases == phases_for("torch") == [
        ("fuse", ["fuse-kda-chunks", "fuse-moe-dispatch", "fuse-attn-res"]), ("quantize", ["quantize-experts"]),
        ("specialize", ["absorb-mla"]), ("cleanup", ["cse", "dce"])]
    with pytest.raises(K3Error):
        pipeline_for("nonsense")


def test_quantize_override_and_dumps(tmp_path):
    m = k3ir.load("k3-tiny")
    res: list[PassResult] = []
    run_pipeline(m, "fuse-moe-dispatch,dce", quantize="int4", dump_dir=str(tmp_path), results=res, verify_each=True)
    assert [r.name for r in res] == ["fuse-moe-dispatch", "quantize-experts{format=int4}", "dce"]
    assert sorted(os.listdir(tmp_path)) == ["00-input.k3", "01-fuse-moe-dispatch.k3", "02-quantize-experts.k3",
                                            "03-dce.k3"]
    for f in sorted(os.listdir(tmp_path)):
        text = (tmp_path / f).read_text()
        assert k3ir.print_module(k3ir.parse_module(text)) == text
    assert {op.attrs["quant"] for op in m.ops("k3.grouped_matmul")} == {"int4"}
    m2 = k3ir.load("k3-tiny")
    run_pipeline(m2, pipeline_for("triton"), quantize="none")
    assert {op.attrs["quant"] for op in m2.ops("k3.moe_experts")} == {"none"}
    with pytest.raises(K3Error, match="needs fuse-moe-dispatch"):
        run_pipeline(k3ir.load("k3-tiny"), ["dce"], quantize="mxfp4")


def test_phased_pipeline_dumps_by_phase_and_pass(tmp_path):
    """A pipeline of named phases: each dump names its phase and pass; a forced quantisation lands in phase quantize."""
    m = k3ir.load("k3-tiny")
    res: list[PassResult] = []
    run_pipeline(m, [("fuse", ["fuse-moe-dispatch"]), ("cleanup", ["dce"])], quantize="int4",
                 dump_dir=str(tmp_path), results=res)
    assert sorted(os.listdir(tmp_path)) == ["00-input.k3", "01-fuse.fuse-moe-dispatch.k3",
                                            "02-quantize.quantize-experts.k3", "03-cleanup.dce.k3"]
    assert [(r.phase, r.name) for r in res] == [("fuse", "fuse-moe-dispatch"), ("quantize", "quantize-experts{format=int4}"),
                                                ("cleanup", "dce")]
    assert "k3.grouped_matmul" in (tmp_path / "01-fuse.fuse-moe-dispatch.k3").read_text()
    with pytest.raises(K3Error, match="phase 'fuse'"):
        run_pipeline(k3ir.load("k3-tiny"), [("fuse", ["dce", " "])])


# ---- golden ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_golden(case):
    d = os.path.join(GOLDEN, case)
    spec = _read(d, "pass.txt").strip()
    text = _read(d, "input.k3")
    m = k3ir.parse_module(text)
    assert k3ir.print_module(m) == text                      # input round-trips
    run_pipeline(m, [spec], verify_each=True)
    want = _read(d, "expected.k3")
    got = k3ir.print_module(m)
    assert got == want, f"{case}: output differs from {d}/expected.k3 (regenerate with tests/passes/golden/make_golden.py)"
    assert k3ir.print_module(k3ir.parse_module(got)) == got


def test_golden_cases_cover_every_pass():
    from k3ir.passes.manager import known_passes
    covered = {_read(os.path.join(GOLDEN, c), "pass.txt").split("{")[0].strip() for c in CASES}
    assert set(known_passes()) <= covered


# ---- the full K3 graph -------------------------------------------------------------------------
def test_kimi_k3_triton_pipeline():
    from k3ir.accounting import report
    m = k3ir.load("kimi-k3")
    cfg = m.config
    before = report(m)
    res: list[PassResult] = []
    run_pipeline(m, pipeline_for("triton"), results=res)
    k3ir.verify_module(m)
    pre, dec = Counter(o.name for o in m.functions["prefill"].ops), Counter(o.name for o in m.functions["decode"].ops)
    assert pre["k3.fused_kda"] == 69 == len(cfg.kda_layers) and pre["k3.moe_dispatch"] == 92
    # decode phase: each MoE layer's routed experts one k3.moe_experts (gate/up GLU, down, combine; MXFP4)
    assert pre["k3.moe_experts"] == 92 and pre["k3.grouped_matmul"] == 0 and pre["k3.moe_combine"] == 0
    assert not any(o.name in ("k3.kda", "k3.moe") for o in m.ops())
    # decode: each KDA layer recurrent; with its output norm in o_proj's k3.decode_linear (decode phase) or not
    kda_dec = [o for n in ("k3.fused_kda", "k3.fused_kda_ungated") for o in m.functions["decode"].walk(n)]
    assert {o.attrs["mode"] for o in kda_dec} == {"recurrent"} and len(kda_dec) == 69
    assert {o.attrs["mode"] for o in m.functions["prefill"].walk("k3.fused_kda")} == {"chunk"}
    assert {o.attrs["quant"] for o in m.ops("k3.moe_experts")} == {"mxfp4"}
    mla_dec = [o for n in ("k3.mla", "k3.mla_kv_norm") for o in m.functions["decode"].walk(n)]
    assert all(o.attrs["absorbed"] for o in mla_dec) and len(mla_dec) == 24 and dec["k3.mla_kv_norm"] > 0
    # bytes: routed experts (92 MoE layers x 3 x 896 x 3584 x 3072) go from 2 to 0.5 + 1/32 bytes
    routed = 92 * 3 * 896 * 3584 * 3072
    after = report(m)
    assert after.param_bytes == pytest.approx(before.param_bytes - routed * (2 - 0.53125), rel=1e-12)
    assert after.params_total == before.params_total          # scales are bytes, not parameters
    assert 5.5e12 < before.param_bytes < 5.6e12 and 1.5e12 < after.param_bytes < 1.6e12
    q = next(r for r in res if r.name == "quantize-experts")
    assert q.details["tensors"] == 3 * 92
    assert q.details["bytes_before"] - q.details["bytes_after"] == routed * (2 - 0.53125)
    shared = [n for n in m.params if "shared_experts" in n]
    assert shared and all(m.params[n].type.dtype == "bf16" for n in shared)


# ---- CLI -------------------------------------------------------------------------------------
def test_cli_compile_dump_and_print(tmp_path, capsys):
    from k3ir.cli import main
    dump, out = tmp_path / "dump", tmp_path / "out"
    assert main(["compile", "k3-tiny", "--target", "torch", "--dump-ir", str(dump), "--verify-each",
                 "--quantize", "mxfp4", "-o", str(out), "--dtype", "float32"]) == 0
    files = sorted(os.listdir(dump))
    assert files[0] == "00-input.k3" and files[1] == "01-fuse.fuse-kda-chunks.k3" and len(files) == 1 + len(
        PIPELINES["torch"])
    assert files[-1] == f"{len(PIPELINES['torch']):02d}-cleanup.dce.k3"          # named by phase and pass
    capsys.readouterr()
    for f in files:
        assert main(["print", str(dump / f)]) == 0
        assert capsys.readouterr().out == (dump / f).read_text()
    info = json.loads((out / "passes.json").read_text())
    assert info["ops"]["decode"]["k3.fused_kda"] == 6 and info["bytes_after"] < info["bytes_before"]
    assert [(p["phase"], p["name"]) for p in info["passes"]][:2] == [("fuse", "fuse-kda-chunks"),
                                                                    ("fuse", "fuse-moe-dispatch")]
    assert main(["compile", "k3-tiny", "--passes", "fuse-kda-chunks{chunk_size=32},dce", "--no-build"]) == 0
    assert main(["compile", "k3-tiny", "--passes", "bogus"]) == 2
    assert "unknown pass 'bogus'" in capsys.readouterr().err


def test_cli_inspect_after_passes(capsys):
    from k3ir.cli import main
    assert main(["inspect", "k3-tiny", "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["inspect", "k3-tiny", "--json", "--after-passes", "--target", "torch", "--quantize", "mxfp4"]) == 0
    after = json.loads(capsys.readouterr().out)
    routed = 8 * 3 * 8 * 32 * 32        # 8 MoE layers x (w1, w3, w2) x 8 experts x 32 x 32, bf16 -> mxfp4
    assert before["param_bytes"] - after["param_bytes"] == routed * 2 - routed * 0.53125
    assert after["params_total"] == before["params_total"]
    assert after["flops_per_token"] == pytest.approx(before["flops_per_token"], rel=1e-12)
    assert after["param_bytes_before_passes"] == before["param_bytes"]
    assert "quantize-experts{format=mxfp4}" in after["passes"]
    assert main(["inspect", "k3-tiny", "--after-passes", "--target", "torch", "--quantize", "mxfp4"]) == 0
    assert "weights 1.01 MB -> 720.88 kB" in " ".join(capsys.readouterr().out.split())   # 1,009,648 - 73,728 B
