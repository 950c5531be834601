"""OpenAI-compatible HTTP API (FastAPI TestClient) and a short loopback load test."""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from k3ir.runtime import Session
from k3ir.runtime.engine import build_engine
from k3ir.runtime.tokenizer import load_tokenizer

import k3ir

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
from fastapi.testclient import TestClient
from k3ir.runtime.server import ServerLimits, create_app


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def session(tiny):
    return Session(k3ir.compile(tiny, target="torch", dtype="float32"), seed=0)


@pytest.fixture(scope="module")
def client(tiny):
    eng = build_engine(tiny, block_size=64, num_blocks=32, max_batch=8)
    app = create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny",
                     ServerLimits(max_request_bytes=2000, max_prompt_tokens=100, max_output_tokens=20, max_concurrent=2))
    with TestClient(app) as c:
        yield c


def greedy_text(session, ids, n):
    out = session.generate(np.array([ids]), n)[0, len(ids):].tolist()
    out = out[:out.index(257) + 1] if 257 in out else out
    return out, bytes(t for t in out if t < 256).decode("utf-8", errors="replace")


def test_completion_greedy_matches_session(client, session):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    ids, text = greedy_text(session, [256] + list(b"Hello"), 6)
    assert body["object"] == "text_completion" and body["model"] == "k3-tiny"
    assert body["choices"][0]["text"] == text
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": len(ids), "total_tokens": 6 + len(ids)}
    assert body["choices"][0]["finish_reason"] == ("stop" if 257 in ids else "length")


def test_completion_token_prompt_and_seeded_sampling(client):
    req = {"prompt": [256, 72, 105], "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 11}
    a, b = client.post("/v1/completions", json=req).json(), client.post("/v1/completions", json=req).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["prompt_tokens"] == 3


def test_chat_completion(client, session):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    prompt = [256] + list(b"system: be brief\nuser: hi\nassistant: ")
    _, text = greedy_text(session, prompt, 5)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(prompt)


def _sse(client, path, payload):
    with client.stream("POST", path, json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]


def test_streaming_equals_non_streaming(client):
    req = {"prompt": "Stream me", "max_tokens": 10, "temperature": 0}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]
    events = _sse(client, "/v1/completions", {**req, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    events = _sse(client, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0, "stream": True})
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_stop_string_cuts_text(client):
    full = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[3:5]
    if not stop or "\ufffd" in stop:
        pytest.skip("generated text has no clean stop string to test with")
    cut = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": stop}).json()
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_models_and_health(client):
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["k3-tiny"]
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["pool"]["blocks"] == 32 and h["pool"]["referenced"] == 0


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "invalid_request"),                 # no prompt
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "max_tokens": 21}).encode(), 400, "max_tokens_exceeded"),
    (json.dumps({"prompt": "x" * 150}).encode(), 400, "context_length_exceeded"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": []}).encode(), 400, "invalid_request"),
    (json.dumps({"prompt": "x", "model": "other"}).encode(), 404, "model_not_found"),
    (json.dumps({"prompt": "x" * 3000}).encode(), 413, "request_too_large"),
])
def test_bad_requests_get_json_errors(client, body, status, code):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"]


@pytest.mark.parametrize("route,extra,code,msg", [
    ("/v1/completions", {"logprobs": 3}, "unsupported_parameter",
     "'logprobs' is not supported by this server (accepted only as null or 0 or false), got 3"),
    ("/v1/completions", {"echo": True}, "unsupported_parameter", "'echo' is not supported"),
    ("/v1/completions", {"presence_penalty": 0.5}, "unsupported_parameter", "'presence_penalty' is not supported"),
    ("/v1/completions", {"bogus": 1}, "unknown_parameter",
     ("unrecognized request field 'bogus' (this endpoint reads: max_tokens, model, n, prompt, seed, stop, stream, "
      "temperature, top_k, top_p, user)")),
    ("/v1/completions", {"tools": [{"type": "function"}]}, "unsupported_parameter", "'tools' is not supported"),
    ("/v1/chat/completions", {"max_tokenz": 3}, "unknown_parameter", "unrecognized request field 'max_tokenz'"),
])
def test_unread_fields_are_a_400_naming_them(client, route, extra, code, msg):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = client.post(route, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == next(iter(extra)) and err["message"].startswith(msg), err


def test_default_valued_openai_fields_are_accepted(client, session):
    req = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=req).json()
    defaults = {"logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0,
                "logit_bias": {}, "suffix": None, "user": "u-1"}
    r = client.post("/v1/completions", json={**req, **defaults})
    assert r.status_code == 200, r.text
    _, text = greedy_text(session, [256] + list(b"Hello"), 4)
    assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"] == text
    msgs = [{"role": "user", "content": "hi"}]
    a = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "temperature": 0}).json()
    b = client.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 3, "temperature": 0,
                                                  "logprobs": False, "tool_choice": "none"}).json()
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "max_completion_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_malformed_and_unknown_route(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "http_404"


def test_concurrency_limit_gives_429(tiny):
    eng = build_engine(tiny, block_size=64, num_blocks=16, max_batch=4)
    app = create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", ServerLimits(max_concurrent=1))
    with TestClient(app) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hold", "max_tokens": 50, "stream": True}) as s:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            s.read()
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_short_loopback_load_test():
    """The suite's 5-second, 4-client version of bench/load_test.py (real uvicorn on 127.0.0.1): one
    client of each role (well-behaved, disconnecting mid-request, hostile bodies, tiny temperatures)."""
    pytest.importorskip("httpx")
    path = Path(__file__).resolve().parents[2] / "bench" / "load_test.py"
    spec = importlib.util.spec_from_file_location("k3ir_load_test", path)
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    url, stop = lt.start_server("k3-tiny", block_size=64, max_batch=8, body_timeout_s=1.0)
    try:
        rep = asyncio.run(lt.run_load(url, clients=4, duration=5.0, max_tokens=8))
    finally:
        stop()
    assert rep["roles"] == {"well": 1, "disconnect": 1, "hostile": 1, "tiny": 1}
    assert lt.failures(rep) == [], rep
    assert rep["requests"] > 0 and set(rep["latency_s"]) >= {"p50", "p90", "p99"}
    assert rep["tiny_temperature"]["requests"] > 0 and rep["disconnecting"]["requests_dropped"] > 0
    assert rep["hostile"]["status"].get("408") == 1 and rep["hostile"]["status"].get("400", 0) >= 5
    assert rep["server_after"]["pool_referenced"] == rep["server_after"]["leaked_blocks"] == 0


def test_lone_surrogate_prompt_is_a_400_naming_it(client):
    # JSON can spell a lone surrogate; no tokenizer can encode it
    r = client.post("/v1/completions", content=b'{"prompt": "ab\\ud800", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "U+D800 at character 2" in err["message"]
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


def test_generate_refuses_a_prompt_that_is_not_utf8(capsys):
    from conftest import one_line_error, run_cli
    bad = b"\xff\xfeab".decode("utf-8", "surrogateescape")       # how Python hands such argv bytes over
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", bad, "--max-tokens", "2")
    assert rc == 2 and "--prompt is not valid UTF-8 text (byte 0xff at character 0)" in one_line_error(err)


@pytest.mark.parametrize("extra,param,msg", [
    ({"max_tokens": "2"}, "max_tokens", "valid integer"),
    ({"max_tokens": True}, "max_tokens", "valid integer"),
    ({"max_tokens": 1e30}, "max_tokens", "valid integer"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"user": 5}, "user", "valid string"),
    ({"seed": "3"}, "seed", "valid integer"),
    ({"temperature": float("nan")}, "temperature", "finite number"),
    ({"top_p": float("inf")}, "top_p", "finite number"),
])
def test_wrong_json_types_are_not_coerced(client, extra, param, msg):
    # Pydantic strict mode: a wrong type is a 400 naming the field, never a silent conversion
    body = json.dumps({"prompt": "a", "max_tokens": 2, **extra}).encode()     # json writes NaN/Infinity
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and msg in err["message"], err


def test_float_fields_take_json_integers_and_unknown_message_keys_are_refused(client):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0, "top_p": 1})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi", "foo": "bar"}], "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages.0.foo" and "Extra inputs are not permitted" in err["message"], err


@pytest.mark.parametrize("argv,msg", [
    (("--log-level", "shout"), "--log-level must be one of critical, error, warning, info, debug, trace, got 'shout'"),
    (("--served-name", ""), "--served-name must not be empty"),
    (("--served-name", "  "), "--served-name must not be empty"),
    (("--body-timeout", "0"), "--body-timeout must be a finite number of seconds > 0, got 0.0"),
    (("--body-timeout", "nan"), "--body-timeout must be a finite number of seconds > 0, got nan"),
    (("--max-stop-strings", "0"), "--max-stop-strings must be >= 1, got 0"),
    (("--max-stop-chars", "-1"), "--max-stop-chars must be >= 1, got -1"),
])
def test_serve_flags_refused_before_the_model_loads(capsys, monkeypatch, argv, msg):
    from conftest import one_line_error, run_cli
    from k3ir.cli import serve as cli_serve
    monkeypatch.setattr(cli_serve, "_setup", lambda args: pytest.fail("the model loaded"))
    rc, _, err = run_cli(capsys, "serve", "k3-tiny", "--port", "0", *argv)
    assert rc == 2 and msg in one_line_error(err), err


def test_serve_log_level_is_case_insensitive_and_listed_in_help(capsys, monkeypatch):
    from conftest import run_cli
    from k3ir.cli import serve as cli_serve
    seen = {}

    def fake_setup(args):
        seen["level"] = args.log_level
        raise cli_serve.UsageError("stop here")
    monkeypatch.setattr(cli_serve, "_setup", fake_setup)
    assert run_cli(capsys, "serve", "k3-tiny", "--port", "0", "--log-level", "DEBUG")[0] == 2
    assert seen["level"] == "debug"
    with pytest.raises(SystemExit):
        run_cli(capsys, "serve", "--help")
    assert "--log-level {critical,error,warning,info,debug,trace}" in capsys.readouterr().out


@pytest.mark.parametrize("body,msg", [
    (b'{"prompt": "a\xff", "max_tokens": 2}', "request body is not valid UTF-8 (invalid start byte at byte 13)"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"prompt": "a", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
])
def test_unparsable_bodies_say_why(tiny, body, msg):
    # FastAPI's bare "There was an error parsing the body" names neither the problem nor the position
    eng = build_engine(tiny, block_size=64, num_blocks=8, max_batch=2)
    app = create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", ServerLimits(max_request_bytes=1 << 20))
    with TestClient(app) as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and msg in err["message"], err
