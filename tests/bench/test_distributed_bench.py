"""bench/distributed_bench.py (issue 24) at its ``--tiny`` sizes: 2 gloo processes with 1 thread each on the CPU, torch
target, started by torchrun. Each item's JSON holds what the two-GPU run records: the equality flags against the
one-process run (SPEC.md 11: 1e-5 float32), the one-device and two-rank timings (3 interleaved repeats) with the
speed-up equal to the medians' quotient, the all-to-all bytes against hand arithmetic of the send buffer
``[E/ep, ep*C, latent]``, the probed bandwidth, and the planner's rows next to the measured bytes. Slow (~10-20 s per
item on 2 free cores); ``python -m pytest -q -m slow tests/bench/test_distributed_bench.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "distributed_bench.py")


def run(item: str, out, *args: str, tiny: bool = True, timeout: float = 300) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT,
                        item, *(["--tiny"] if tiny else []), "--out", str(out), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"{item}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.rstrip().splitlines()[-1].startswith("|"), "the table is printed last"
    with open(out) as f:
        d = json.load(f)
    m = d["meta"]
    assert m["benchmark"] == f"distributed_{item}" and m["world"] == 2
    assert m["backend"] == ("gloo" if tiny else "nccl") and m["tiny"] is tiny
    assert m["commit"] and m["date"]
    return d


def check_spread(s: dict, n: int = 3) -> None:
    assert len(s["runs"]) == n and all(v > 0 for v in s["runs"])
    assert s["min"] == min(s["runs"]) and s["max"] == max(s["runs"]) and s["median"] == sorted(s["runs"])[n // 2]


def test_equality_rows(tmp_path):
    d = run("equality", tmp_path / "eq.json")
    rows = d["rows"]
    assert {(r["model"], r["layout"]) for r in rows} == {(m, f"{a}=2") for m in ("k3-tiny", "kimi-linear-tiny")
                                                         for a in ("ep", "cp", "tp")}
    for r in rows:
        assert r["dtype"] == "float32" and r["tol"] == 1e-5
        assert r["equal"] is True and r["greedy_tokens_equal"] is True
        assert 0 <= r["prefill_rel"] < 1e-5 and 0 <= r["decode_rel"] < 1e-5


@pytest.mark.gpu
def test_equality_on_two_gpus_with_nccl_and_triton(tmp_path):
    """Issue 24 item 1 on two GPUs: NCCL, triton target, float32 and bf16 (tolerances of SPEC.md 11)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    d = run("equality", tmp_path / "eq.json", tiny=False, timeout=600)
    rows = d["rows"]
    assert len(rows) == 12 and {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert r["target"] == "triton" and r["equal"] is True, r


def test_kcp_prefill_rows(tmp_path):
    d = run("kcp", tmp_path / "kcp.json")
    assert d["ceilings"]["measured"] is True
    rows = {r["case"]: r for r in d["rows"]}
    assert set(rows) == {"stack", "model"}
    for case, r in rows.items():
        assert r["seq"] == 250 and r["cp"] == 2                        # segments of 125: not multiples of the chunk
        check_spread(r["one_gpu_s"])
        check_spread(r["two_gpu_s"])
        assert r["speedup"] == pytest.approx(r["one_gpu_s"]["median"] / r["two_gpu_s"]["median"])
        assert r["equal"] is True and r["logits_rel"] < 1e-5 and r["state_rel_max"] < 1e-5
        kda = [k for k in r["state_rel"] if k.endswith("_kda_state")]
        assert len(kda) == r["kda_layers"] == (4 if case == "stack" else 3)
        # every KDA layer all-gathers its (M, S_loc) (k3.kcp_scan) and every short conv its halo
        assert r["collectives_rank0"]["all_gather"]["calls"] >= r["kda_layers"]
    assert "l3_mla_cache" in rows["model"]["state_rel"]


def test_ep_moe_layer_row(tmp_path):
    d = run("ep", tmp_path / "ep.json")
    (r,) = d["rows"]
    assert (r["experts"], r["top_k"], r["latent"], r["tokens"]) == (8, 2, 32, 64)
    assert r["equal"] is True and r["out_rel"] < 1e-5
    assert r["capacity"] == r["max_load_per_source_rank"] + 8
    check_spread(r["one_gpu_s"])
    check_spread(r["two_gpu_s"])
    assert r["speedup"] == pytest.approx(r["one_gpu_s"]["median"] / r["two_gpu_s"]["median"])
    # dispatch + combine, each all_to_all_single of the [E/ep, ep*C, latent] float32 buffer; half of it leaves the rank
    buf = 8 * r["capacity"] * 32 * 4
    assert r["a2a_calls"] == 2 and r["a2a_payload_bytes"] == 2 * buf and r["a2a_bytes_sent"] == buf
    bw = r["probe"]["all_to_all"]["Bps"]["median"]
    assert r["probe"]["all_to_all"]["bytes_sent_per_call"] == pytest.approx(buf / 2, rel=1e-3) and bw > 0
    assert r["probe"]["send_recv"]["Bps"]["median"] > 0
    assert r["a2a_fraction_of_probe_bw"] == pytest.approx(buf / r["two_gpu_s"]["median"] / bw)


def test_ep_drops_are_caught(tmp_path):
    """One row less than the largest load drops a token copy: the equality flag must go false (exit code 1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT,
                        "ep", "--tiny", "--capacity-pad", "-1", "--repeats", "1", "--out", str(tmp_path / "ep.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode != 0
    (r,) = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert r["equal"] is False and r["out_rel"] > 1e-3


def test_plan_rows_next_to_measured_bytes(tmp_path):
    d = run("plan", tmp_path / "plan.json")
    rows = {next(k for k, v in r["layout"].items() if v == 2): r for r in d["rows"]}
    assert set(rows) == {"ep", "tp", "cp", "dp"}
    for a, r in rows.items():
        assert r["errors"] == [None, None]
        assert r["plan_per_rank_bytes"] == pytest.approx(sum(r["plan_memory"].values()))
        assert r["plan_memory"]["workspace"] == 4e9
        assert r["measured_peak_allocated_per_rank"] == [None, None]       # no CUDA allocator on the CPU
        sent = r["measured_sent_bytes_per_rank"]
        assert (max(sent) == 0) == (a == "dp")                           # dp: replicas, nothing sent
    ep = rows["ep"]
    col = ep["measured_collectives"][0]["all_to_all"]
    C = ep["ep_capacity"]
    assert C >= 1 and col["calls"] % 2 == 0
    assert col["payload_bytes"] == col["calls"] * 8 * C * 32 * 4          # k3-tiny: E 8, latent 32, float32
