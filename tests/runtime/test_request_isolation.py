"""One request cannot fail or slow the others: sampling edge values inside a shared batch, client
disconnects that free the request's slot and pool blocks at once, body read timeouts, bounded
``stop`` lists, 413 for oversized bodies however they are sent, JSON error bodies from the HTTP layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import greedy_alone, tiny_torch_session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.sampler import TEMPERATURE_FLOOR, SamplingParams, filtered_probs, sample

import k3ir


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def session(tiny):
    return tiny_torch_session(tiny)



# ---- sampling parameters at their edges ------------------------------------------------------------
@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-200, 1e-30, 1e-10, TEMPERATURE_FLOOR / 2])
def test_temperature_below_the_floor_is_greedy(t):
    logits = torch.tensor([0.5, 3.0, 3.0, 1.0, -2.0])                  # tie at ids 1, 2: greedy takes 1
    assert sample(logits, SamplingParams(temperature=t, seed=1), torch.Generator().manual_seed(1)) == 1
    np.testing.assert_array_equal(filtered_probs(logits, t).numpy(), [0, 1, 0, 0, 0])


def test_temperature_at_the_floor_still_samples_softmax():
    logits = torch.tensor([0.0, 1e-5, 0.0], dtype=torch.float64)     # at T = 1e-5: exp(0), exp(1), exp(0)
    e = np.exp([0.0, 1.0, 0.0])
    np.testing.assert_allclose(filtered_probs(logits, TEMPERATURE_FLOOR).numpy(), e / e.sum(), rtol=1e-9)


def test_float64_logits_that_overflow_under_temperature_take_the_limit():
    logits = torch.tensor([1e305, -1e305, 1.5e305], dtype=torch.float64)    # / 1e-4 leaves the float64 range
    np.testing.assert_array_equal(filtered_probs(logits, 1e-4).numpy(), [0, 0, 1])


EDGE_PARAMS = [
    SamplingParams(max_tokens=5, temperature=5e-324, seed=1),
    SamplingParams(max_tokens=5, temperature=1e-300, top_p=5e-324, seed=2),
    SamplingParams(max_tokens=5, temperature=100.0, top_k=10 ** 30, top_p=1.0, seed=2 ** 63 - 1),
    SamplingParams(max_tokens=5, temperature=0.7, top_k=1, seed=0),
    SamplingParams(max_tokens=5, temperature=1.0, top_p=1e-300, seed=-1),
    SamplingParams(max_tokens=1, temperature=2e-5, stop_token_ids=[10 ** 12, -1]),
]


def test_edge_sampling_params_in_a_batch_leave_the_others_unchanged(tiny, session):
    normal = [list(b"Kimi "), list(b"hello there"), list(b"x" * 70)]
    edge = [list(b"edge %d" % i) for i in range(len(EDGE_PARAMS))]
    eng = build_engine(tiny, block_size=64, num_blocks=64, max_batch=16)
    reqs = eng.generate(normal + edge, [SamplingParams(max_tokens=5)] * len(normal) + EDGE_PARAMS)
    assert eng.stats["rows"] > eng.stats["calls"]                      # the requests shared model calls
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [(r.finish_reason, r.error) for r in reqs]
    for p, r in zip(normal, reqs):
        assert r.output == greedy_alone(session, p, 5)
    # below the floor, with top_p down to 5e-324 or top_k 1: the greedy tokens
    for i in (0, 1, 3, 4):
        assert reqs[len(normal) + i].output == greedy_alone(session, edge[i], 5)
    assert reqs[-1].output == greedy_alone(session, edge[-1], 1)


def test_a_row_that_raises_while_sampling_ends_only_its_request(tiny, session, monkeypatch):
    from k3ir.runtime import engine as engine_mod
    real = engine_mod.sample

    def flaky(row, params, generator):
        if params.seed == 666:
            raise RuntimeError("sampler broke")
        return real(row, params, generator)
    monkeypatch.setattr(engine_mod, "sample", flaky)
    eng = build_engine(tiny, block_size=64, num_blocks=64, max_batch=8)
    prompts = [list(b"abc"), list(b"def"), list(b"ghi")]
    reqs = eng.generate(prompts, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, seed=666),
                                  SamplingParams(max_tokens=4)])
    assert reqs[1].finish_reason == "error" and "sampler broke" in reqs[1].error
    assert reqs[0].output == greedy_alone(session, prompts[0], 4) and reqs[2].output == greedy_alone(session, prompts[2], 4)
    assert eng.pool.num_referenced == 0 and eng.reserved == 0


# ---- HTTP: limits answered with JSON errors ---------------------------------------------------------
fastapi = pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")


def _app(tiny):
    """A fresh app (its engine thread starts once, with the app's lifespan)."""
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer
    eng = build_engine(tiny, block_size=64, num_blocks=48, max_batch=8)
    limits = ServerLimits(max_request_bytes=4000, max_output_tokens=2000, max_concurrent=4, max_stop_strings=4,
                          max_stop_chars=40, body_timeout_s=0.5)
    return create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", limits)


@pytest.fixture(scope="module")
def app(tiny):
    return _app(tiny)


@pytest.fixture(scope="module")
def client(app):
    from fastapi.testclient import TestClient
    with TestClient(app) as c:
        yield c


def _json_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("stop,msg", [
    (["a"] * 100_000, "stop has 100000 strings, the limit is 4"),
    (["x" * 20, "y" * 21], "stop strings hold 41 characters in all, the limit is 40"),
    ("z" * 41, "stop strings hold 41 characters in all, the limit is 40"),
])
def test_stop_lists_over_the_limits_are_a_400_naming_stop(tiny, stop, msg):
    from fastapi.testclient import TestClient
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer
    eng = build_engine(tiny, block_size=64, num_blocks=8, max_batch=2)
    limits = ServerLimits(max_request_bytes=1 << 20, max_stop_strings=4, max_stop_chars=40)
    with TestClient(create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", limits)) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stop": stop})
        err = _json_error(r, 400)
        assert err["param"] == "stop" and err["message"] == msg
        ok = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stop": ["x" * 20, "y" * 19, "", "q"]})
        assert ok.status_code == 200, ok.text


def test_oversized_chunked_body_is_a_413(client):
    def chunks():                                     # no Content-Length: httpx sends it chunked
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _json_error(r, 413, "request_too_large")
    r = client.post("/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text                   # a small chunked body is read whole


def test_unexpected_exception_is_a_json_500(app, monkeypatch):
    from fastapi.testclient import TestClient
    monkeypatch.setattr(app.state.engine, "make_request", lambda *a, **k: 1 / 0)
    client = TestClient(app, raise_server_exceptions=False)        # the server's answer, not the exception
    err = _json_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}), 500, "internal_error")
    assert "ZeroDivisionError" in err["message"]


# ---- HTTP over a real loopback socket: disconnects, slow bodies, unparsable requests ---------------------
@pytest.fixture(scope="module")
def live(tiny):
    """(host, port) of an app served by ``make_server`` (uvicorn, h11) on 127.0.0.1 in a thread."""
    import threading
    import time

    from k3ir.runtime.server import make_server
    server = make_server(_app(tiny), "127.0.0.1", 0, log_level="warning")
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        assert time.time() - t0 < 60 and th.is_alive(), "server did not start"
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[:2]
    server.should_exit = True
    th.join(10)


def _raw(addr, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    import socket
    with socket.create_connection(addr, timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _split(resp: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _health(addr) -> dict:
    import json
    return json.loads(_split(_raw(addr, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))[2])


@pytest.mark.parametrize("cl", [b"-5", b"abc", b"1e3"])
def test_malformed_content_length_gets_a_json_400(live, cl):
    import json
    resp = _raw(live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + cl + b"\r\n\r\n{}")
    status, headers, body = _split(resp)
    assert status == 400 and headers["content-type"] == "application/json", resp
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")


def test_incomplete_body_times_out_with_a_json_408(live):
    import json
    import time
    t0 = time.perf_counter()
    resp = _raw(live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ", timeout=10)
    took = time.perf_counter() - t0
    status, headers, body = _split(resp)                  # _raw returned: the server closed the connection
    assert status == 408 and headers["connection"] == "close", resp
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "within 0.5 s (11 bytes arrived)" in err["message"]
    assert 0.4 < took < 5


def _wait(cond, timeout: float) -> float:
    import time
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < timeout, "condition not reached"
        time.sleep(0.02)
    return time.perf_counter() - t0


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_client_frees_its_slot_and_blocks_at_once(live, stream):
    """A 2,000-token greedy request (~30 s of decoding alone) is cancelled when its client leaves."""
    import json
    import socket
    body = json.dumps({"prompt": "abandon me", "max_tokens": 2000, "temperature": 0, "stream": stream}).encode()
    s = socket.create_connection(live, timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    _wait(lambda: (h := _health(live))["running"] == 1 and h["engine"]["decode_tokens"] > 3, 30)
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.close()
    _wait(lambda: (h := _health(live))["in_flight"] == h["running"] == h["pool"]["referenced"] == 0, 1.5)
    h = _health(live)
    assert h["waiting"] == 0 and h["engine"]["decode_tokens"] < 1000 and h["engine"]["aborted"] >= 1
    assert h["pool"]["leaked_blocks"] == 0 and h["pool"]["reserved"] == 0 and h["pool"]["leaked_reserve"] == 0
