"""Prometheus metrics of a serving engine (``GET /metrics``, text exposition format, prometheus-client).

Event metrics are observed from the engine's thread through ``Engine.observers``: requests finished by
reason, prompt and generated tokens, time to first token (from the request's creation) and inter-token
latency (seconds between a request's consecutive tokens). State metrics are read at scrape time: prefix-hit
tokens per cache tier (``device``, ``host``), pool blocks by state, host-tier bytes, running and waiting
requests. Each ``EngineMetrics`` has its own registry (several apps in one process do not collide)."""
from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: histogram bucket bounds in seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _PoolCollector:
    """Reads the engine's pool and queues at scrape time."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        eng, p = self.engine, self.engine.pool
        hits = CounterMetricFamily("k3ir_prefix_hit_tokens", "prompt tokens found in the prefix cache, by tier",
                                   labels=["tier"])
        hits.add_metric(["device"], p.stats["hit_tokens_device"])
        hits.add_metric(["host"], p.stats["hit_tokens_host"])
        yield hits
        blocks = GaugeMetricFamily("k3ir_pool_blocks", "device pool blocks by state", labels=["state"])
        blocks.add_metric(["free"], p.num_free)
        blocks.add_metric(["cached"], p.num_cached)
        blocks.add_metric(["referenced"], p.num_referenced)
        yield blocks
        yield GaugeMetricFamily("k3ir_pool_block_size_tokens", "tokens per pool block", value=p.block_size)
        yield GaugeMetricFamily("k3ir_host_cache_bytes", "bytes held by the prefix cache's host tier",
                                value=p.host_used)
        yield GaugeMetricFamily("k3ir_host_cache_budget_bytes", "byte budget of the host tier", value=p.host_bytes)
        yield GaugeMetricFamily("k3ir_host_cache_entries", "host-tier entries (full blocks and tails)",
                                value=len(p.host))
        yield GaugeMetricFamily("k3ir_requests_running", "requests in the running batch", value=len(eng.running))
        yield GaugeMetricFamily("k3ir_requests_waiting", "requests queued for admission", value=len(eng.waiting))


class EngineMetrics:
    """Metrics of ``engine`` in a registry of their own; ``attach`` registers the observer. ``render()``
    gives ``(body bytes, content type)`` of the text exposition format."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k3ir_requests", "requests finished, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("k3ir_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("k3ir_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("k3ir_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("k3ir_inter_token_latency_seconds", "seconds between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        r.register(_PoolCollector(engine))
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()

    def attach(self) -> EngineMetrics:
        if self.observe not in self.engine.observers:
            self.engine.observers.append(self.observe)
        return self

    def observe(self, req: Any, token: int | None) -> None:
        """Engine observer: ``token`` None when ``req`` finished."""
        now = time.perf_counter()
        key = id(req)
        with self._lock:
            if token is None:
                self._last.pop(key, None)
                self.requests.labels(finish_reason=req.finish_reason or "unknown").inc()
                self.prompt_tokens.inc(len(req.prompt))
                return
            self.generation_tokens.inc()
            last = self._last.get(key)
            if last is None:
                self.ttft.observe(max(0.0, now - req.created))
            else:
                self.itl.observe(now - last)
            self._last[key] = now

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
