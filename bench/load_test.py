"""Bounded loopback load test of ``k3ir serve``: N concurrent clients send completion requests to
127.0.0.1 for D seconds, then stop; reports throughput and latency percentiles as JSON.

    python bench/load_test.py --clients 32 --duration 60            # starts its own server (k3-tiny)
    python bench/load_test.py --url http://127.0.0.1:8000 ...        # against a running server

Each client loops: pick a prompt (random length, some sharing a prefix so the prefix cache is
exercised), POST /v1/completions (every 4th request streams by SSE), check the answer. A request
that is not answered with 200 and a well-formed body counts as an error. Exit status 1 on errors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str = "k3-tiny", block_size: int = 64, max_batch: int = 32, max_concurrent: int = 256):
    """Start ``k3ir serve`` in-process on a free loopback port (uvicorn in a thread).
    Returns (base url, stop function)."""
    import uvicorn
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer

    import k3ir
    m = k3ir.load(model)
    engine = build_engine(m, block_size=block_size, max_batch=max_batch)
    app = create_app(engine, load_tokenizer(model, m), model, ServerLimits(max_concurrent=max_concurrent))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        if time.time() - t0 > 60 or not th.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        th.join(30)
    return f"http://127.0.0.1:{port}", stop


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    import numpy as np
    p50, p90, p99 = np.percentile(np.asarray(xs), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": max(xs), "mean": sum(xs) / len(xs)}


async def _client(cid: int, url: str, deadline: float, max_tokens: int, out: dict, stems: list[str]) -> None:
    import httpx
    rnd = random.Random(cid)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            n = rnd.randint(1, 200)
            prompt = stems[rnd.randrange(len(stems))][:n] if rnd.random() < 0.5 else \
                "".join(rnd.choice("abcdefghij klmnop") for _ in range(n))
            body = {"prompt": prompt, "max_tokens": rnd.randint(1, max_tokens), "temperature": rnd.choice([0, 0.8]),
                    "seed": cid * 100000 + i, "stream": i % 4 == 0}
            t0 = time.perf_counter()
            try:
                if body["stream"]:
                    first, chunks = None, 0
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        ok = r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                if first is None:
                                    first = time.perf_counter() - t0
                                if line[6:].strip() == "[DONE]":
                                    break
                                json.loads(line[6:])["choices"][0]
                                chunks += 1
                    ok = ok and chunks >= 1
                    if first is not None:
                        out["ttft"].append(first)
                    ntok = None
                else:
                    r = await c.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                    ntok = r.json()["usage"]["completion_tokens"] if ok else None
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - every failure is an error of the run
                out["errors"].append(f"{type(e).__name__}: {e}")
                continue
            if not ok:
                out["errors"].append(f"status {r.status_code}: {r.text[:200] if not body['stream'] else ''}")
                continue
            out["latency"].append(dt)
            out["requests"] += 1
            if ntok is not None:
                out["tokens"] += ntok
                out["nonstream"] += 1


async def run_load(url: str, clients: int, duration: float, max_tokens: int = 16) -> dict:
    """Run ``clients`` concurrent clients for ``duration`` seconds against ``url``; returns the report."""
    rnd = random.Random(0)
    stems = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(200)) for _ in range(4)]
    out = {"latency": [], "ttft": [], "errors": [], "requests": 0, "tokens": 0, "nonstream": 0}
    t0 = time.perf_counter()
    await asyncio.gather(*[_client(i, url, t0 + duration, max_tokens, out, stems) for i in range(clients)])
    wall = time.perf_counter() - t0
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        health = (await c.get("/health")).json()
    return {"clients": clients, "duration_s": duration, "wall_s": round(wall, 2), "requests": out["requests"],
            "errors": len(out["errors"]), "error_samples": out["errors"][:5],
            "requests_per_s": round(out["requests"] / wall, 2),
            "completion_tokens_per_s_nonstream": round(out["tokens"] / wall, 1),
            "latency_s": {k: round(v, 4) for k, v in _percentiles(out["latency"]).items()},
            "ttft_stream_s": {k: round(v, 4) for k, v in _percentiles(out["ttft"]).items()},
            "server": {"pool": health.get("pool"), "engine": health.get("engine")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running server (default: start one on 127.0.0.1)")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (the run then stops)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    a = p.parse_args(argv)
    stop = None
    url = a.url
    if url is None:
        url, stop = start_server(a.model, a.block_size, a.max_batch)
    try:
        rep = asyncio.run(run_load(url, a.clients, a.duration, a.max_tokens))
    finally:
        if stop is not None:
            stop()
    sys.stdout.write(json.dumps(rep, indent=2) + "\n")
    return 1 if rep["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
