"""The OpenAI-style HTTP API's request format: the README's ``curl`` examples run as written, a body sent with a
content type other than JSON is a 400 naming the header to send, and a JSON body that is not an object is a 400."""
from __future__ import annotations

import json
import os
import re
import shlex

import pytest

import k3ir


@pytest.fixture(scope="module")
def api():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer
    tiny = k3ir.load("k3-tiny")
    eng = build_engine(tiny, block_size=64, num_blocks=16, max_batch=4)
    with TestClient(create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", ServerLimits())) as c:
        yield c


def _readme_curls() -> list[tuple[str, str, dict]]:
    """(route, header, JSON body) of every ``curl`` line of README.md (continuation lines joined)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip().startswith("curl "):
            argv = shlex.split(line)
            route = re.sub(r"^(https?://)?[^/]+", "", next(a for a in argv[1:] if "/v1/" in a))
            out.append((route, argv[argv.index("-H") + 1], json.loads(argv[argv.index("-d") + 1])))
    return out


def test_readme_curl_examples_work(api):
    curls = _readme_curls()
    assert {r for r, _, _ in curls} == {"/v1/completions", "/v1/chat/completions"}
    for route, header, body in curls:
        assert header == "Content-Type: application/json"
        r = api.post(route, json=body)
        assert r.status_code == 200, (route, r.text)
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            # a random model may sample its EOS early (no seed in the README's bodies): then it says "stop"
            done = r.json()
            n = done["usage"]["completion_tokens"]
            assert n == body["max_tokens"] or (n < body["max_tokens"] and done["choices"][0]["finish_reason"] == "stop")


@pytest.mark.parametrize("ctype", [None, "text/plain"])
def test_non_json_content_type_names_the_header(api, ctype):
    body = '{"prompt": "x", "max_tokens": 2}'
    headers = {"Content-Type": ctype} if ctype else {"Content-Type": "application/x-www-form-urlencoded"}
    r = api.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_content_type"
    assert "'Content-Type: application/json'" in err["message"] and (ctype or "x-www-form-urlencoded") in err["message"]


def test_json_that_is_not_an_object(api):
    r = api.post("/v1/completions", json=[1])
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]


def test_content_as_text_parts_equals_the_joined_string(api):
    """OpenAI's list form of ``content`` (text parts): the same greedy answer as the parts joined into one
    string; an image part is a 400 naming the field."""
    def ask(content):
        r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                   "max_tokens": 6, "temperature": 0})
        return r
    joined = ask("Kimi compiles fast")
    parts = ask([{"type": "text", "text": "Kimi "}, {"type": "text", "text": "compiles fast"}])
    assert joined.status_code == parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == joined.json()["choices"][0]["message"]
    assert parts.json()["usage"]["prompt_tokens"] == joined.json()["usage"]["prompt_tokens"]
    bad = ask([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert bad.status_code == 400 and "messages.0.content" in bad.json()["error"]["message"], bad.text
