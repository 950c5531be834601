"""Fuzzed HTTP bodies against the OpenAI-compatible server, in process (ASGI app through
starlette's TestClient): whatever a client sends, the answer is never a 5xx, and every 4xx body
is an OpenAI-style JSON error with a message."""
from __future__ import annotations

import json

import pytest

import k3ir

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "n", "model", "user", "logprobs", "echo", "best_of", "logit_bias", "tools")
FUZZ = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer
    tiny = k3ir.load("k3-tiny")
    eng = build_engine(tiny, block_size=64, num_blocks=16, max_batch=8)
    limits = ServerLimits(max_request_bytes=8192, max_prompt_tokens=64, max_output_tokens=3, max_concurrent=8,
                          max_stop_strings=4, max_stop_chars=64, body_timeout_s=5)
    with TestClient(create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", limits)) as c:
        yield c


def check_answer(r, stream: bool) -> None:
    """No 5xx; a 4xx is a JSON error with a message; a 200 is a well-formed completion or SSE stream
    that ends with [DONE] and holds no error event."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:200])
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events
        assert all("error" not in json.loads(e) for e in events[:-1]), events
    else:
        assert not stream
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 3


def post(client, route: str, content: bytes, ctype: str = "application/json"):
    return client.post(route, content=content, headers={"content-type": ctype})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@FUZZ
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=300),
       ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_raw_bytes_never_5xx(client, route, raw, ctype):
    check_answer(post(client, route, raw, ctype), stream=False)


@FUZZ
@given(route=st.sampled_from(ROUTES),
       body=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6))
def test_json_objects_with_any_field_values_never_5xx(client, route, body):
    check_answer(post(client, route, json.dumps(body).encode()), stream=body.get("stream") is True)


tiny_floats = st.sampled_from([5e-324, 1e-300, 1e-30, 1e-8, 9.99e-6, 1e-5])
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": st.text(max_size=10)}), min_size=1, max_size=2)


@FUZZ
@given(route=st.sampled_from(ROUTES), temperature=tiny_floats | st.floats(0, 100),
       top_p=tiny_floats | st.floats(0, 1, exclude_min=True), top_k=st.integers(0, 2 ** 70),
       seed=st.integers(0, 2 ** 63 - 1) | st.none(), max_tokens=st.integers(1, 3), stream=st.booleans(),
       stop=st.none() | st.text(max_size=8) | st.lists(st.text(max_size=8), max_size=4),
       prompt=st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 257), min_size=1, max_size=8),
       msgs=messages,
       breaker=st.none() | st.tuples(st.sampled_from(FIELDS), json_values))
def test_valid_requests_with_edge_values_never_5xx(client, route, temperature, top_p, top_k, seed, max_tokens,
                                                   stream, stop, prompt, msgs, breaker):
    """In-range sampling parameters at their edges (subnormal temperature and top_p, top_k far above
    the vocabulary, the largest seed), sometimes with one field replaced by any JSON value."""
    body = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "max_tokens": max_tokens,
            "stream": stream, "stop": stop}
    body.update({"prompt": prompt} if route == ROUTES[0] else {"messages": msgs})
    if breaker is not None:
        body[breaker[0]] = breaker[1]
    check_answer(post(client, route, json.dumps(body).encode()), stream=body.get("stream") is True)


def test_tiny_temperature_next_to_normal_requests_all_succeed(client):
    """The HTTP path of the isolation fix: a subnormal temperature is greedy, not a failed batch."""
    greedy = client.post("/v1/completions", json={"prompt": "Kimi", "max_tokens": 3, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={"prompt": "Kimi", "max_tokens": 3, "temperature": 5e-324}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
