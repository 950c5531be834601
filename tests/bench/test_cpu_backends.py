"""``bench/cpu_backends.py`` at tiny size (``kimi-linear-tiny``: a KimiLinearConfig saved by transformers, so every
route runs, transformers too): one JSON with the copy bandwidth measured in the run, each route's tokens/s over 3
repeats, its decode roofline fraction computed from the JSON's own bandwidth and bytes, and the same prefill logits
on every route (against the first route, torch). Slow: five routes built, TVM at opt-level 3."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _installed(name: str) -> bool:
    """``name`` importable (a dotted name whose parent package is missing counts as absent, not an error)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not all(_installed(m) for m in ("tvm.script", "onnxruntime", "iree.compiler")),
                    reason="needs apache-tvm, onnxruntime and IREE (pip install -e '.[test]')")
def test_every_cpu_route_at_tiny_size(tmp_path):
    pytest.importorskip("transformers.models.kimi_linear")
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3IR_")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "cpu_backends.py"), "--models", "kimi-linear-tiny",
                        "--T", "8", "--steps", "2", "--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt")],
                       capture_output=True, text=True, check=False, cwd=ROOT, env=env, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out) as f:
        rep = json.load(f)
    assert rep["meta"]["env_switches"] == {} and rep["ceilings"]["measured"]
    bw = rep["ceilings"]["copy_Bps"]["median"]
    rows = {r["route"]: r for r in rep["rows"]}
    assert set(rows) == {"torch", "onnxruntime", "iree", "tvm-llvm", "transformers"}, [r.get("error") for r in
                                                                                          rep["rows"]]
    for route, r in rows.items():
        assert "error" not in r, (route, r.get("error"))
        for key in ("prefill_tok_s", "decode_tok_s"):
            s = r[key]
            assert len(s["runs"]) == 3 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0
        need = r["decode_bytes_per_token"]["total"]
        assert r["decode_roofline_fraction"] == pytest.approx(r["decode_tok_s"]["median"] * need / bw)
        assert r["logits_rel_err"]["vs"] == "torch"
        assert r["logits_rel_err"]["value"] < (1e-3 if route == "transformers" else 1e-4), (route, r["logits_rel_err"])
    assert rows["torch"]["logits_rel_err"]["value"] == 0.0
