"""``GET /metrics``: Prometheus text format read back with ``prometheus_client.parser``; counts checked
against the requests sent and the pool's own books."""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from k3ir.runtime.engine import build_engine
from k3ir.runtime.server import create_app
from k3ir.runtime.tokenizer import load_tokenizer
from prometheus_client.parser import text_string_to_metric_families

import k3ir


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


def _scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_scrape_counts_requests_tokens_latency_and_pool(tiny):
    eng = build_engine(tiny, block_size=128, num_blocks=16, max_batch=4, host_cache_bytes=1 << 20)
    app = create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 200).tolist()    # the second request hits block 0 and the prompt-end tail (128..192)
    with TestClient(app) as client:
        before = _scrape(client)
        assert before[("k3ir_requests_running", ())] == 0 and ("k3ir_generation_tokens_total", ()) in before
        outs = []
        for n in (3, 5):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
            assert r.status_code == 200
            outs.append(r.json()["usage"])
        m = _scrape(client)
    gen = sum(u["completion_tokens"] for u in outs)
    reasons = {k[1][0][1]: v for k, v in m.items() if k[0] == "k3ir_requests_total"}
    assert sum(reasons.values()) == 2 and set(reasons) <= {"length", "stop"}
    assert m[("k3ir_prompt_tokens_total", ())] == 2 * 200
    assert m[("k3ir_generation_tokens_total", ())] == gen
    assert m[("k3ir_time_to_first_token_seconds_count", ())] == 2
    assert m[("k3ir_inter_token_latency_seconds_count", ())] == gen - 2
    assert m[("k3ir_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert 0 < m[("k3ir_time_to_first_token_seconds_sum", ())] < 60
    assert m[("k3ir_prefix_hit_tokens_total", (("tier", "device"),))] == 128
    assert m[("k3ir_prefix_hit_tokens_total", (("tier", "host"),))] == 64
    blocks = {k[1][0][1]: v for k, v in m.items() if k[0] == "k3ir_pool_blocks"}
    assert blocks == {"free": eng.pool.num_free, "cached": eng.pool.num_cached, "referenced": 0}
    assert sum(blocks.values()) == 16 and blocks["cached"] >= 1
    assert m[("k3ir_host_cache_budget_bytes", ())] == 1 << 20
    assert m[("k3ir_host_cache_bytes", ())] == eng.pool.host_used > 0          # the requests' tails
