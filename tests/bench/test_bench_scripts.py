"""The GPU bench scripts at their ``--tiny`` sizes on the CPU (TRITON_INTERPRET=1): each runs end to end and its JSON
holds the same-run pieces the benchmark rules ask for (bench/README.md): the ceilings measured in this run, every
baseline timed in the same process with 3 interleaved repeats, ratios equal to the medians' quotient, floors computed
from the JSON's own ceilings, errors against the peer small. fla is usually absent here: its rows must then say why.
Slow (minutes each under the interpreter); ``python -m pytest -q -m slow tests/bench/test_bench_scripts.py``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
HAVE_FLA = importlib.util.find_spec("fla") is not None


def run(script: str, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    # the shipped defaults: no K3IR_* switch from the environment the suite runs in
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3IR_")}
    env.update(TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.pop("OUT", None)            # the scripts must not read it: --out decides
    p = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"{script} {args}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def check_report(d: dict, benchmark: str) -> None:
    """meta (commit, date, command, no K3IR_* switches) and ceilings measured in this run."""
    m = d["meta"]
    assert m["benchmark"] == benchmark
    assert m["commit"] and m["date"] and m["command"].startswith("python3 ")
    assert m["env_switches"] == {}
    c = d["ceilings"]
    assert c["measured"] is True and c["device"] == "cpu"
    for key in ("copy_Bps", "matmul_flops"):
        s = c[key]
        assert len(s["runs"]) == 3 and all(v > 0 for v in s["runs"])
        assert s["min"] <= s["median"] <= s["max"]


def check_spread(s: dict, n: int = 3) -> None:
    assert len(s["runs"]) == n and all(v > 0 for v in s["runs"])
    assert s["min"] == min(s["runs"]) and s["max"] == max(s["runs"]) and s["median"] == sorted(s["runs"])[n // 2]


def test_kda_forward_compare(tmp_path):
    sys.path.insert(0, BENCH)
    from bench_kda import fwd_cost
    out = tmp_path / "kda_forward.json"
    run("bench_kda.py", "--compare", "--tiny", "--shapes", "1,70,2,32", "--out", str(out))
    d = load(out)
    check_report(d, "kda_forward")
    assert [(r["shape"], r["gate"]) for r in d["rows"]] == [([1, 70, 2, 32], "k3"), ([1, 70, 2, 32], "softplus")]
    cp, mm = d["ceilings"]["copy_Bps"]["median"], d["ceilings"]["matmul_flops"]["median"]
    for r in d["rows"]:
        check_spread(r["ours_ms"])
        assert r["ours_finite"]
        nbytes, flops = fwd_cost(1, 70, 2, 32)
        assert r["floor_ms"] == pytest.approx(max(nbytes / cp, flops / mm) * 1e3, rel=1e-9)
        if HAVE_FLA and r["fla_ms"] is not None:
            check_spread(r["fla_ms"])
            assert r["ratio_fla_over_ours"] == pytest.approx(r["fla_ms"]["median"] / r["ours_ms"]["median"])
            assert r["err_ours_vs_fla_o"] < 1e-3
        else:
            assert r["fla_ms"] is None and r["ratio_fla_over_ours"] is None and "fla" in r["fla_skipped"]
    warm = tmp_path / "warm.json"
    run("bench_kda.py", "--compare", "--warm", "--tiny", "--shapes", "1,70,2,32", "--out", str(warm))
    assert not warm.exists()                # --warm times nothing and writes nothing


def test_kda_decode(tmp_path):
    out = tmp_path / "kda_decode.json"
    run("bench_kda.py", "--decode", "--tiny", "--out", str(out))
    d = load(out)
    check_report(d, "kda_decode")
    assert [r["shape"] for r in d["rows"]] == [[1, 1, 2, 32], [3, 1, 2, 32]]
    for r in d["rows"]:
        check_spread(r["ours_ms"])
        if HAVE_FLA:
            check_spread(r["fla_ms"])
            assert r["ratio_fla_over_ours"] == pytest.approx(r["fla_ms"]["median"] / r["ours_ms"]["median"])
            assert r["err_ours_vs_fla_o"] < 1e-5 and r["err_ours_vs_fla_state"] < 1e-5   # float32, same state
        else:
            assert r["fla_ms"] is None and "fla" in r["fla_skipped"]


def test_kda_forward_backward_both_policies(tmp_path):
    out = tmp_path / "bench_kda_bwd.json"
    run("bench_kda_bwd.py", "--tiny", "--jobs", "acc_sp,time_k3", "--budget", "1400", "--out", str(out))
    d = load(out)
    check_report(d, "bench_kda_bwd")
    assert [j["status"] for j in d["jobs"]] == ["ok", "ok"]
    acc = next(r for r in d["rows"] if r["section"] == "accuracy")
    # float32 toy sizes: ours (keep) and ours_recompute against the fp32 torch reference, per input gradient
    assert max(acc["ours"].values()) < 1e-4 and max(acc["ours_recompute"].values()) < 1e-4
    t = next(r for r in d["rows"] if r["section"] == "time")
    assert t["shipped_bwd_reuse"] is True and "tuning_overrides" not in t
    for key in ("ours_keep", "ours_recompute"):
        check_spread(t["ms"][key])
    # the two policies compute the same gradients (keep vs recompute, same inputs, grads zeroed before each call)
    assert max(t["grad_err_vs_ours_keep"]["ours_recompute"].values()) < 1e-4
    for pol in ("keep", "recompute"):
        if f"fla_{pol}" in t["ms"]:
            assert t[f"ratio_fla_over_ours_{pol}"] == pytest.approx(t["ms"][f"fla_{pol}"]["median"]
                                                                   / t["ms"][f"ours_{pol}"]["median"])
        else:                                # fla absent or failing here: said so, no ratio
            assert f"ratio_fla_over_ours_{pol}" not in t
            assert t.get("fla_skipped") or t.get(f"fla_{pol}_error")


def test_moe_layer(tmp_path):
    out = tmp_path / "bench_moe_layer.json"
    run("bench_moe_layer.py", "--tiny", "--out", str(out))
    d = load(out)
    check_report(d, "bench_moe_layer")
    cases = [(r["case"], r["tokens"]) for r in d["rows"]]
    assert cases == [("bf16 experts", 64), ("bf16 experts", 16), ("mxfp4 experts", 16), ("mxfp4 whole layer", 16)]
    cp, mm = d["ceilings"]["copy_Bps"]["median"], d["ceilings"]["matmul_flops"]["median"]
    for r in d["rows"][:2]:
        for key in ("ours_ms", "grouped_mm_gemm_only_ms", "grouped_mm_eager_ms"):
            check_spread(r[key])
        assert r["ratio_gemm_only_over_ours"] == pytest.approx(r["grouped_mm_gemm_only_ms"]["median"]
                                                               / r["ours_ms"]["median"])
        assert r["ratio_eager_over_ours"] == pytest.approx(r["grouped_mm_eager_ms"]["median"] / r["ours_ms"]["median"])
        assert r["err_ours_vs_grouped_mm"] < 1e-4          # float32: the same function as the eager baseline
        assert r["floor_ms"] == pytest.approx(max(r["weight_bytes"] / cp, r["flops"] / mm) * 1e3, rel=1e-9)
    for r in d["rows"][2:]:
        assert "error" not in r, r
        check_spread(r["ours_ms"])
        assert r["ours_finite"]


def test_moe_sweep(tmp_path):
    out = tmp_path / "moe_sweep.json"
    run("moe_sweep.py", "--tiny", "--only", "bf16 T=256", "--budget", "1200", "--out", str(out))
    d = load(out)
    check_report(d, "moe_sweep")
    base = next(r for r in d["rows"] if r["name"] == "bf16 T=256 torch._grouped_mm")
    ours = next(r for r in d["rows"] if r["name"] == "bf16 T=256 default")
    check_spread(base["ms"])
    check_spread(ours["ms"])
    assert ours["shipped_default"] is True
    assert ours["ratio_grouped_mm_over_ours"] == pytest.approx(base["ms"]["median"] / ours["ms"]["median"])
    assert ours["rel_err_vs_grouped_mm"] < 1e-4


def test_bench_models_kimi_vs_transformers(tmp_path):
    pytest.importorskip("transformers")
    import transformers
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip("this transformers has no KimiLinearForCausalLM")
    out = tmp_path / "bench_models.json"
    # the torch target keeps this minutes, not an hour, under the CPU interpreter; the script logic is the same
    run("bench_models.py", "--sections", "kimi", "--tiny", "--target", "torch", "--no-prewarm", "--out", str(out))
    d = load(out)
    check_report(d, "bench_models")
    rows = {r["name"]: r for r in d["rows"]}
    assert "FAILED" not in rows, rows.get("FAILED")
    assert rows["logits controls full model (B2 T64)"]["torch_vs_hf"] < 1e-4     # float32, same weights
    cp = d["ceilings"]["copy_Bps"]["median"]
    for name in ("prefill B1 T128", "prefill B2 T8", "decode B1 after 8", "decode B2 after 8"):
        r = rows[name]
        check_spread(r["tok_s"])
        check_spread(r["transformers_tok_s"])
        assert r["ratio_ours_over_transformers"] == pytest.approx(r["tok_s"]["median"]
                                                                  / r["transformers_tok_s"]["median"])
    # the default row segments (a 64-token segment under --tiny); the labelled variant runs one call, same run
    default, var = rows["prefill B1 T128"], rows["prefill B1 T128 variant prefill_chunk=128"]
    assert (default["prefill_chunk"], default["calls"], var["prefill_chunk"], var["calls"]) == (64, 2, 128, 1)
    assert var["variant"].startswith("not the default") and "ratio_ours_over_transformers" not in var
    check_spread(var["tok_s"])
    assert var["variant_over_default"] == pytest.approx(var["tok_s"]["median"] / default["tok_s"]["median"])
    assert var["variant_over_transformers"] == pytest.approx(var["tok_s"]["median"]
                                                             / default["transformers_tok_s"]["median"])
    # roofline of the tiny model (KL_SMALL_TOP2: 3 MoE layers of 8 experts, top-2, one expert 3 x 128 x 256)
    for B, n_exp in ((1, 2.0), (2, 3.5)):          # 8 (1 - (6/8)^B)
        r = rows[f"decode B{B} after 8"]
        assert (r["num_experts"], r["top_k"], r["moe_layers"], r["expert_params"]) == (8, 2, 3, [98304] * 3)
        assert r["active_params"] == r["dense_params"] + 2 * 3 * 98304
        assert r["routed_experts_expected"] == n_exp
        s1 = r["state_bytes_per_seq"]
        assert r["bytes_per_step"] == 2 * (r["dense_params"] + 3 * n_exp * 98304) + B * s1
        assert r["roofline_tok_s"] == pytest.approx(cp / r["bytes_per_step"] * B)
        assert r["bytes_per_step_active_once"] == 2 * r["active_params"] + B * s1
        # measured: the distinct experts of each timed step's top-k indices (B1: exactly 2; B2: 2 to 4)
        hit = r["routed_experts_measured_per_layer"]
        assert len(hit) == 3 and all(B * 2 >= h >= 2 for h in hit), hit
        if B == 1:
            assert hit == [2.0] * 3
        assert r["bytes_per_step_measured_routing"] == pytest.approx(2 * (r["dense_params"] + sum(hit) * 98304) + B * s1)
        assert r["roofline_measured_routing_tok_s"] == pytest.approx(cp / r["bytes_per_step_measured_routing"] * B)
    b1 = rows["decode B1 after 8"]
    assert b1["bytes_per_step"] == b1["bytes_per_step_active_once"] == b1["bytes_per_step_measured_routing"]


def test_bench_models_decode(tmp_path):
    out = tmp_path / "kimi_linear_decode.json"
    run("bench_models.py", "--sections", "decode", "--tiny", "--target", "torch", "--out", str(out))
    d = load(out)
    check_report(d, "kimi_linear_decode")
    (r,) = d["rows"]
    check_spread(r["tok_s"])
    bpt = r["weight_bytes"] + r["state_bytes"]
    assert r["weight_bytes"] == 2 * r["active_params"] and r["routed_experts"] == 8        # KL_SMALL: top-8 of 8
    assert r["roofline_tok_s"] == pytest.approx(d["ceilings"]["copy_Bps"]["median"] / bpt)


def test_gpu_model_check(tmp_path):
    out = tmp_path / "gpu_model_check.json"
    run("gpu_model_check.py", "--tiny", "--budget", "1300", "--out", str(out))
    d = load(out)
    assert d["meta"]["benchmark"] == "gpu_model_check"
    steps = [r["step"] for r in d["rows"]]
    assert steps == ["prefill", "decode1", "decode2", "decode3"]
    assert all(r["ok"] and r["rel"] < r["tol"] for r in d["rows"])


def test_gpu_verification_runner(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    run("gpu_verification.py", "run", "--call", "3", "--steps", "kda_decode", "--tiny", "--budget", "1200",
        "--out", str(out))
    log = load(out / "gpu_verification.json")
    assert [(r["step"], r["status"], r["written"]) for r in log["results"]] == [("kda_decode", "ok", True)]
    check_report(load(out / "kda_decode.json"), "kda_decode")
    p = run("gpu_verification.py", "collect", str(out), "--results", str(results))
    meta = load(out / "kda_decode.json")["meta"]
    assert (results / "kda_decode" / f"{meta['date']}-{meta['commit']}.json").exists(), p.stdout
    plan = run("gpu_verification.py", "plan").stdout
    for n in range(1, 6):
        assert f"gpu_verification.py run --call {n} --out $OUT" in plan
    assert 'carry=[".gpuhead", ".whl"]' in plan
