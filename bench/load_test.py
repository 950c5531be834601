"""Bounded loopback load test of ``k3ir serve``: N concurrent clients send requests to 127.0.0.1
for D seconds, then stop; reports throughput, latency percentiles, 5xx counts and the server's pool
accounting after the run as JSON.

    python bench/load_test.py --clients 16 --duration 60            # starts its own server (k3-tiny)
    python bench/load_test.py --url http://127.0.0.1:8000 ...        # against a running server

Clients and what each does in a loop:
- well-behaved (the rest): a prompt of random length (some share a prefix, so the prefix cache is
  exercised), POST /v1/completions (every 4th request streams by SSE), check the answer; their
  latencies are the ones reported;
- disconnecting (``--disconnect-frac``, default 10%): send a long request (streamed or not) over a raw
  socket and close the connection 0.05-1 s later, mid-request;
- hostile (``--hostile-frac``, default 5%): bodies that are not JSON, too deep, of the wrong types, with
  100k stop strings, over the size limit (by Content-Length and chunked), with a negative
  Content-Length, and once an incomplete body (answered after the server's body timeout); every answer
  must be a 4xx with a JSON error (or a 200 for the valid ones);
- tiny temperature (``--tiny-temperature-clients``, default 1): valid requests with temperatures
  5e-324 .. 1e-6, which must succeed next to everyone else's.
After the run the script waits (bounded) for the server to go idle and reads ``/health``: in-flight,
running and waiting requests and the pool's referenced and leaked blocks must all be 0.
Exit status 1 on any 5xx, any failed well-behaved or tiny-temperature request, any hostile answer that
is not a JSON 4xx, or leaked blocks.
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
from urllib.parse import urlsplit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str = "k3-tiny", block_size: int = 64, max_batch: int = 32, max_concurrent: int = 256,
                 body_timeout_s: float = 30.0):
    """Start ``k3ir serve`` in-process on a free loopback port (``runtime.server.make_server``: uvicorn
    in a thread). Returns (base url, stop function)."""
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app, make_server
    from k3ir.runtime.tokenizer import load_tokenizer

    import k3ir
    m = k3ir.load(model)
    engine = build_engine(m, block_size=block_size, max_batch=max_batch)
    app = create_app(engine, load_tokenizer(model, m), model,
                     ServerLimits(max_concurrent=max_concurrent, body_timeout_s=body_timeout_s))
    port = _free_port()
    server = make_server(app, "127.0.0.1", port, log_level="warning")
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


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in d.items()}


async def _completion(c, body: dict, t0: float) -> tuple[int, bool, int | None, float | None, list[float]]:
    """POST ``body`` to /v1/completions through httpx client ``c``: (status, well-formed, completion tokens or
    None for a stream, time to first SSE event, gaps in seconds between successive text events of a stream: the
    inter-token latency where each token decodes to text, as the server sends one event per non-empty delta)."""
    if not body["stream"]:
        r = await c.post("/v1/completions", json=body)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return r.status_code, ok, r.json()["usage"]["completion_tokens"] if ok else None, None, []
    first, chunks, done, last, gaps = None, 0, False, None, []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                if line[6:].strip() == "[DONE]":
                    done = True
                    break
                choice = json.loads(line[6:])["choices"][0]
                chunks += 1
                if choice.get("text") and choice.get("finish_reason") is None:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    return r.status_code, r.status_code == 200 and done and chunks >= 1, None, first, gaps


def _count_status(out: dict, status: int) -> None:
    out["status"][str(status)] = out["status"].get(str(status), 0) + 1


async def _well_behaved(cid: int, url: str, deadline: float, max_tokens: int, out: dict, stems: list[str],
                        tiny_temperature: bool = False) -> None:
    import httpx
    rnd = random.Random(cid)
    temps = [5e-324, 1e-300, 1e-30, 1e-10, 1e-6] if tiny_temperature else [0, 0.8]
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            n = rnd.randint(1, 200)
            prompt = stems[rnd.randrange(len(stems))][:n] if rnd.random() < 0.5 else \
                "".join(rnd.choice("abcdefghij klmnop") for _ in range(n))
            body = {"prompt": prompt, "max_tokens": rnd.randint(1, max_tokens), "temperature": rnd.choice(temps),
                    "seed": cid * 100000 + i, "stream": i % 4 == 0}
            t0 = time.perf_counter()
            try:
                status, ok, ntok, first, gaps = await _completion(c, body, t0)
            except Exception as e:  # noqa: BLE001 - every failure is an error of the run
                out["errors"].append(f"{type(e).__name__}: {e}")
                continue
            _count_status(out, status)
            if not ok:
                out["errors"].append(f"status {status} (stream={body['stream']}, temperature={body['temperature']})")
                continue
            out["latency"].append(time.perf_counter() - t0)
            if first is not None:
                out["ttft"].append(first)
            out["itl"].extend(gaps)
            out["requests"] += 1
            if ntok is not None:
                out["tokens"] += ntok
                out["nonstream"] += 1


async def _raw_exchange(host: str, port: int, head: bytes, parts: list[bytes], read_timeout: float = 60.0,
                        close_after: float | None = None) -> bytes:
    """Send ``head`` and ``parts`` on a fresh connection; read the answer until the server closes it
    (or ``read_timeout``), or close the connection ourselves ``close_after`` seconds after sending."""
    reader, writer = await asyncio.open_connection(host, port)
    data = b""
    try:
        try:
            writer.write(head)
            for p in parts:
                writer.write(p)
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError):   # the server answered (413) before the body ended
            pass
        if close_after is not None:          # read what comes, then drop the connection
            try:
                async with asyncio.timeout(close_after):
                    while chunk := await reader.read(65536):
                        data += chunk
            except (TimeoutError, ConnectionResetError):
                pass
            return data
        try:
            async with asyncio.timeout(read_timeout):
                while chunk := await reader.read(65536):
                    data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return data
    finally:
        writer.close()


def _request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_post(path: str, body: bytes, ctype: str = "application/json") -> tuple[bytes, list[bytes]]:
    return _request_head(path, {"Content-Type": ctype, "Content-Length": str(len(body))}), [body]


def _status_of(resp: bytes) -> int | None:
    try:
        return int(resp.split(b"\r\n", 1)[0].split()[1])
    except (IndexError, ValueError):
        return None


async def _disconnecting(cid: int, url: str, deadline: float, out: dict) -> None:
    """Long requests whose client closes the connection mid-request."""
    u = urlsplit(url)
    rnd = random.Random(cid)
    i = 0
    while time.perf_counter() < deadline:
        i += 1
        body = json.dumps({"prompt": "".join(rnd.choice("abcdefgh ") for _ in range(rnd.randint(1, 150))),
                           "max_tokens": 200, "temperature": rnd.choice([0, 0.8]), "stream": i % 2 == 0}).encode()
        got = await _raw_exchange(u.hostname, u.port, *_json_post("/v1/completions", body),
                                  close_after=rnd.uniform(0.05, 1.0))
        status = _status_of(got)
        if status is not None:
            _count_status(out, status)
        out["dropped"] += 1


def _hostile_requests(limit_bytes: int) -> list[tuple[str, bytes, list[bytes], set[int]]]:
    """(name, request head, body parts, acceptable statuses) of the hostile client's cycle."""
    P = "/v1/completions"
    big = b"x" * 65536
    n_big = limit_bytes // len(big) + 2
    chunked = [b"%x\r\n" % len(big) + big + b"\r\n" for _ in range(n_big)] + [b"0\r\n\r\n"]
    return [
        ("not json", *_json_post(P, b"{not json"), {400}),
        ("nested 100k deep", *_json_post(P, b"[" * 100000 + b"]" * 100000), {400, 413}),
        ("wrong types", *_json_post(P, json.dumps({"prompt": 5, "max_tokens": "2", "stream": "yes"}).encode()), {400}),
        ("100k stop strings", *_json_post(P, json.dumps({"prompt": "a", "stop": ["ab"] * 100000}).encode()), {400}),
        ("unknown field", *_json_post(P, json.dumps({"prompt": "a", "bogus": 1}).encode()), {400}),
        ("token ids outside the vocabulary", *_json_post(P, json.dumps({"prompt": [1, 10 ** 30]}).encode()), {400}),
        ("lone surrogate", *_json_post(P, b'{"prompt": "a\\ud800"}'), {400}),
        ("form encoding", *_json_post(P, b"prompt=hi", "application/x-www-form-urlencoded"), {400}),
        ("not utf-8", *_json_post(P, b'{"prompt": "\xff\xfe"}'), {400}),
        ("edge sampling values", *_json_post(P, json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 5e-324,
                                                            "top_p": 5e-324, "top_k": 10 ** 30,
                                                            "seed": 2 ** 63 - 1}).encode()), {200}),
        ("negative Content-Length", _request_head(P, {"Content-Type": "application/json", "Content-Length": "-5"}),
         [b"{}"], {400}),
        ("Content-Length over the limit", _request_head(P, {"Content-Type": "application/json",
                                                            "Content-Length": str(limit_bytes + 1)}), [big], {413}),
        ("chunked body over the limit", _request_head(P, {"Content-Type": "application/json",
                                                          "Transfer-Encoding": "chunked"}), chunked, {413}),
    ]


async def _hostile(cid: int, url: str, deadline: float, out: dict, limit_bytes: int) -> None:
    u = urlsplit(url)

    async def one(name: str, head: bytes, parts: list[bytes], want: set[int], read_timeout: float = 60.0) -> None:
        resp = await _raw_exchange(u.hostname, u.port, head, parts, read_timeout=read_timeout)
        status = _status_of(resp)
        out["hostile"] += 1
        if status is None:
            out["hostile_bad"].append(f"{name}: no answer")
            return
        _count_status(out, status)
        hdr, _, payload = resp.partition(b"\r\n\r\n")
        if status not in want:
            out["hostile_bad"].append(f"{name}: status {status}")
        elif status >= 400:
            try:
                msg = json.loads(payload)["error"]["message"]
                assert isinstance(msg, str) and msg and b"application/json" in hdr.lower()
            except Exception:  # noqa: BLE001 - any shape other than a JSON error is a finding
                out["hostile_bad"].append(f"{name}: {status} without a JSON error body: {payload[:80]!r}")
    slow = asyncio.ensure_future(one("incomplete body", _request_head("/v1/completions", {
        "Content-Type": "application/json", "Content-Length": "100"}), [b'{"prompt": '], {408}, read_timeout=90.0))
    cycle = _hostile_requests(limit_bytes)
    i = 0
    while time.perf_counter() < deadline:
        await one(*cycle[i % len(cycle)])
        i += 1
        await asyncio.sleep(0.05)            # one client, not a flood
    await slow


def _roles(clients: int, disconnect_frac: float, hostile_frac: float, tiny_clients: int) -> list[str]:
    """Role of each client: ``disconnect`` and ``hostile`` counts are the fractions of ``clients``
    rounded (at least 1 when the fraction is > 0), then ``tiny`` ones; the rest are ``well``."""
    def count(frac: float) -> int:
        return max(1, round(frac * clients)) if frac > 0 else 0
    roles = ["disconnect"] * count(disconnect_frac) + ["hostile"] * count(hostile_frac) + ["tiny"] * tiny_clients
    if len(roles) >= clients:
        raise ValueError(f"{clients} clients leave none well-behaved after {len(roles)} special ones")
    return roles + ["well"] * (clients - len(roles))


async def _server_after(url: str, wait_s: float) -> dict:
    """``/health`` once the server is idle (no request in flight, running or waiting), waiting at most
    ``wait_s`` seconds."""
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        t0 = time.perf_counter()
        while True:
            h = (await c.get("/health")).json()
            if h["in_flight"] == h["running"] == h["waiting"] == 0 or time.perf_counter() - t0 > wait_s:
                h["idle_after_s"] = round(time.perf_counter() - t0, 2)
                return h
            await asyncio.sleep(0.1)


async def run_load(url: str, clients: int, duration: float, max_tokens: int = 16, disconnect_frac: float = 0.1,
                   hostile_frac: float = 0.05, tiny_temperature_clients: int = 1,
                   limit_bytes: int = 1 << 20) -> dict:
    """Run ``clients`` concurrent clients for ``duration`` seconds against ``url`` (roles: ``_roles``;
    ``limit_bytes`` the server's body limit, for the hostile oversized bodies); returns the report."""
    rnd = random.Random(0)
    stems = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(200)) for _ in range(4)]
    roles = _roles(clients, disconnect_frac, hostile_frac, tiny_temperature_clients)

    def fresh() -> dict:
        return {"latency": [], "ttft": [], "itl": [], "errors": [], "requests": 0, "tokens": 0, "nonstream": 0, "status": {},
                "dropped": 0, "hostile": 0, "hostile_bad": []}
    outs = {r: fresh() for r in ("well", "tiny", "disconnect", "hostile")}
    t0 = time.perf_counter()
    end = t0 + duration
    tasks = []
    for cid, role in enumerate(roles):
        if role in ("well", "tiny"):
            tasks.append(_well_behaved(cid, url, end, max_tokens, outs[role], stems, tiny_temperature=role == "tiny"))
        elif role == "disconnect":
            tasks.append(_disconnecting(cid, url, end, outs[role]))
        else:
            tasks.append(_hostile(cid, url, end, outs[role], limit_bytes))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    health = await _server_after(url, 60)
    n5xx = sum(v for o in outs.values() for k, v in o["status"].items() if k.startswith("5"))
    pool = health.get("pool") or {}
    well, tiny, disc, host = outs["well"], outs["tiny"], outs["disconnect"], outs["hostile"]
    return {"clients": clients, "roles": {r: roles.count(r) for r in ("well", "disconnect", "hostile", "tiny")},
            "duration_s": duration, "wall_s": round(wall, 2), "status_5xx": n5xx,
            "requests": well["requests"], "errors": len(well["errors"]), "error_samples": well["errors"][:5],
            "requests_per_s": round(well["requests"] / wall, 2),
            "completion_tokens_per_s_nonstream": round(well["tokens"] / wall, 1),
            "latency_s": _rounded(_percentiles(well["latency"])),
            "ttft_stream_s": _rounded(_percentiles(well["ttft"])),
            "inter_token_stream_s": _rounded(_percentiles(well["itl"])),
            "well_behaved_status": well["status"],
            "tiny_temperature": {"requests": tiny["requests"], "errors": len(tiny["errors"]),
                                 "error_samples": tiny["errors"][:5], "status": tiny["status"]},
            "disconnecting": {"requests_dropped": disc["dropped"], "status_seen": disc["status"]},
            "hostile": {"requests": host["hostile"], "bad_answers": host["hostile_bad"][:10],
                        "n_bad_answers": len(host["hostile_bad"]), "status": host["status"]},
            "server_after": {"idle_after_s": health.get("idle_after_s"), "in_flight": health.get("in_flight"),
                             "running": health.get("running"), "waiting": health.get("waiting"),
                             "pool_referenced": pool.get("referenced"), "leaked_blocks": pool.get("leaked_blocks"),
                             "leaked_reserve": pool.get("leaked_reserve"), "pool": pool,
                             "engine": health.get("engine")}}


def failures(rep: dict) -> list[str]:
    """What in a ``run_load`` report breaks the acceptance (empty: none)."""
    bad = []
    if rep["status_5xx"]:
        bad.append(f"{rep['status_5xx']} answers with a 5xx status")
    if rep["errors"] or rep["tiny_temperature"]["errors"]:
        bad.append(f"{rep['errors']} well-behaved and {rep['tiny_temperature']['errors']} tiny-temperature "
                   "requests failed")
    if rep["hostile"]["n_bad_answers"]:
        bad.append(f"{rep['hostile']['n_bad_answers']} hostile requests not answered with a JSON 4xx")
    after = rep["server_after"]
    if after["in_flight"] or after["running"] or after["waiting"]:
        bad.append(f"server not idle after the run: {after['in_flight']} in flight")
    if after["pool_referenced"] or after["leaked_blocks"] or after["leaked_reserve"]:
        bad.append(f"pool blocks leaked: {after['pool_referenced']} referenced, {after['leaked_blocks']} leaked, "
                   f"{after['leaked_reserve']} reserved")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running server (default: start one on 127.0.0.1)")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (the run then stops)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.1, help="fraction of clients that disconnect mid-request")
    p.add_argument("--hostile-frac", type=float, default=0.05, help="fraction of clients sending hostile bodies")
    p.add_argument("--tiny-temperature-clients", type=int, default=1)
    p.add_argument("--limit-bytes", type=int, default=1 << 20, help="the server's --max-request-bytes")
    p.add_argument("--body-timeout", type=float, default=30.0, help="body read timeout of the server it starts")
    a = p.parse_args(argv)
    stop = None
    url = a.url
    if url is None:
        url, stop = start_server(a.model, a.block_size, a.max_batch, body_timeout_s=a.body_timeout)
    try:
        rep = asyncio.run(run_load(url, a.clients, a.duration, a.max_tokens, a.disconnect_frac, a.hostile_frac,
                                   a.tiny_temperature_clients, a.limit_bytes))
    finally:
        if stop is not None:
            stop()
    rep["failures"] = failures(rep)
    sys.stdout.write(json.dumps(rep, indent=2) + "\n")
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
