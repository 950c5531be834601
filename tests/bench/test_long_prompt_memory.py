"""bench/long_prompt_memory.py (issue 21: long prompts in linear memory): the linearity rule on hand-made peaks, and
the script end to end at tiny lengths on the torch and onnx targets: one fresh process per length, the JSON's
machine, load and command, and the greedy next token of each row equal across targets and paths (the same random
k3-tiny and prompt: onnx against the torch peer, the engine against ``Session.prefill``)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "long_prompt_memory.py")


def _module():
    spec = importlib.util.spec_from_file_location("long_prompt_memory", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_per_token_rule_hand_computed():
    """Per-token growth in KiB = MiB step * 1024 / tokens step: 64 MiB over 16k tokens and 128 MiB over 32k are
    4 KiB each (linear: met); 128 MiB over 16k (8 KiB) then 512 MiB over 32k (16 KiB, a quadratic term) is not.
    Lengths below 16k and failed children (None) do not count; fewer than three lengths from 16k on: None."""
    rule = _module().per_token_rule
    r = rule({8192: 100.0, 16384: 500.0, 32768: 564.0, 65536: 692.0})
    assert r == {"steps": [(16384, 32768), (32768, 65536)], "per_token_kib": [4.0, 4.0], "linear": True}
    r = rule({16384: 500.0, 32768: 628.0, 65536: 1140.0})
    assert r["per_token_kib"] == [8.0, 16.0] and r["linear"] is False
    r = rule({16384: 500.0, 32768: 564.0, 65536: 564.0 + 128 * 1.1 + 0.5})   # 4.4 KiB + a hair: above 1.1 x 4
    assert r["linear"] is False
    assert rule({16384: 500.0, 32768: 564.0, 65536: None}) is None
    assert rule({1024: 300.0, 2048: 310.0, 4096: 330.0}) is None


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / f"{'-'.join(args).replace(' ', '')}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3IR_")}
    p = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    assert p.returncode == 0, f"{args}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.rstrip().splitlines()[-1].startswith("|"), "the table is printed last"
    with open(out) as f:
        return json.load(f)


def _check(d: dict, target: str, via: str, lengths: list[int]) -> None:
    assert d["target"] == target and d["via"] == via and d["commit"] and d["date"]
    assert d["command"].startswith("python bench/long_prompt_memory.py ") and f"--target {target}" in d["command"]
    assert d["machine"]["cpus"] >= 1 and "load average" in d["uptime_start"] and "load average" in d["uptime_end"]
    rows = d["rows"]
    assert [r["T"] for r in rows] == lengths and all(r["ok"] is True for r in rows), rows
    assert len({r["pid"] for r in rows}) == len(rows) != 0 and os.getpid() not in {r["pid"] for r in rows}
    for r in rows:
        assert 50 < r["before_prefill_mib"] <= r["peak_rss_mib"] and r["prefill_s"] > 0
        if r["prefill_peak_mib"] is not None:       # None where the kernel refuses the VmHWM reset
            # VmHWM and ru_maxrss read the kernel's per-CPU RSS counters exactly / approximately: 1 MiB of slack
            assert r["rss_at_prefill_mib"] <= r["prefill_peak_mib"] <= r["peak_rss_mib"] + 1
    assert d["rule"] is None                        # tiny lengths: nothing from 16k on


@pytest.mark.slow
def test_script_torch_session_and_onnx_engine_agree(tmp_path):
    """onnx through the engine at two lengths (the longer one in three pool blocks and prompt segments of 64) and
    torch through ``Session.prefill`` (segments of 64) at the longer one: every row ok, one fresh process per
    length, the same greedy next token on both targets and paths (~16 s of CPU in three children and two parents:
20-45 s on the shared 2-core machine, so slow)."""
    onnx_e = _run(tmp_path, "--target", "onnx", "--via", "engine", "--lengths", "96", "160", "--block", "64",
                  "--prefill-tokens", "64")
    _check(onnx_e, "onnx", "engine", [96, 160])
    torch_s = _run(tmp_path, "--lengths", "160", "--chunk", "64")
    _check(torch_s, "torch", "session", [160])
    assert onnx_e["rows"][1]["next_token"] == torch_s["rows"][0]["next_token"]
