"""Operating the server: the API key (``--api-key`` / ``K3IR_API_KEY``, a bearer token, ``/health``
open) and the drain on SIGTERM (no new connections; a streaming request in flight finishes within
``--drain-timeout``, or is cancelled with a ``server_shutdown`` error event; the process exits 0),
the latter against real ``k3ir serve`` processes."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import k3ir
from k3ir.errors import K3RuntimeError

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient
from k3ir.runtime.engine import build_engine
from k3ir.runtime.server import ServerLimits, create_app
from k3ir.runtime.tokenizer import load_tokenizer

TWO_LAYERS = {"num_hidden_layers": 2}        # k3-tiny cut to 2 layers: faster steps


@pytest.fixture(scope="module")
def client():
    tiny = k3ir.load("k3-tiny", overrides=TWO_LAYERS)
    eng = build_engine(tiny, block_size=64, num_blocks=16, max_batch=4)
    app = create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", ServerLimits(max_request_bytes=2000),
                     api_key="s3cret")
    with TestClient(app) as c:
        yield c


def test_health_is_open_everything_else_needs_the_key(client):
    assert client.get("/health").status_code == 200
    for headers, why in (({}, "no API key was sent"), ({"Authorization": "Bearer wrong"}, "the API key is not valid"),
                         ({"Authorization": "Basic s3cret"}, "the API key is not valid")):
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["message"].startswith(why)
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "k3-tiny"
    r = client.post("/v1/completions", headers=ok, json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # the key is checked before the body is read: an oversized body without it is a 401, not a 413
    r = client.post("/v1/completions", content=b"x" * 5000, headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    assert client.post("/v1/completions", content=b"x" * 5000, headers=ok).status_code == 413


def test_empty_key_and_bad_drain_timeout_are_refused(capsys):
    tiny = k3ir.load("k3-tiny", overrides=TWO_LAYERS)
    with pytest.raises(K3RuntimeError, match="API key must not be empty"):
        create_app(build_engine(tiny, block_size=64, num_blocks=4, max_batch=1), load_tokenizer("k3-tiny", tiny),
                   "k3-tiny", api_key=" ")
    with pytest.raises(K3RuntimeError, match="drain_timeout_s"):
        ServerLimits(drain_timeout_s=0)
    from conftest import one_line_error, run_cli
    code, _, err = run_cli(capsys, "serve", "k3-tiny", "--api-key", "")
    assert code == 2 and "--api-key must not be empty" in one_line_error(err)
    code, _, err = run_cli(capsys, "serve", "k3-tiny", "--drain-timeout", "nan")
    assert code == 2 and "--drain-timeout must be a finite number" in one_line_error(err)


# ---- real processes: the key from the environment, SIGTERM during a stream -------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(drain_timeout: float):
    """A ``k3ir serve`` process with its key in K3IR_API_KEY; returns (process, url)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3ir.cli", "serve", "k3-tiny", "--set", "num_hidden_layers=2",
                             "--port", str(port), "--block-size", "64", "--num-blocks", "64", "--max-batch", "2",
                             "--threads", "1", "--max-output-tokens", "4000", "--drain-timeout", str(drain_timeout),
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "K3IR_API_KEY": "k"})
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.time() - t0 < 120, "k3ir serve did not start"
        time.sleep(0.3)


def _stream_then_sigterm(proc, url: str, max_tokens: int) -> tuple[list[str], bool]:
    """Start a streaming chat, send SIGTERM after its first token, read it to the end. Returns the data
    events and whether a new connection was refused while the stream was still being answered."""
    events, refused = [], None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 2:                      # the role chunk, then the first token
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                try:
                    httpx.get(url + "/health", timeout=2)
                    refused = False
                except httpx.ConnectError:
                    refused = True
    return events, refused


def test_key_from_environment_and_sigterm_drains_a_stream():
    proc, url = _serve(drain_timeout=60)
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        events, refused = _stream_then_sigterm(proc, url, max_tokens=40)
        assert refused, "a new connection was accepted after SIGTERM"
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert chunks[-1]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["delta"].get("content")) >= 1
        assert proc.wait(60) == 0
    finally:
        proc.kill()


def test_sigterm_cancels_what_outlasts_the_drain_timeout():
    proc, url = _serve(drain_timeout=1)
    try:
        t0 = time.time()
        events, _ = _stream_then_sigterm(proc, url, max_tokens=3000)
        err = json.loads(events[-1])["error"]
        assert err["code"] == "server_shutdown" and "[DONE]" not in events
        assert proc.wait(60) == 0
        assert time.time() - t0 < 40          # 3000 tokens would take minutes
    finally:
        proc.kill()
