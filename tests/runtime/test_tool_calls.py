"""Tool calls through ``/v1/chat/completions``: the Kimi tool-call markup parsed into OpenAI
``tool_calls`` (``runtime/serve_tools.py``), whole and streamed as deltas, control ids of the markers
shown only where they must be seen, ``tool_choice`` and the request rules, and a two-turn conversation
through the official ``openai`` client against a real ``k3ir serve`` process.

The bundled k3-tiny has random weights, so the answers are forced: ``install_scripted_sampler``
replaces ``Engine._sample`` with one that sets the logits row to one-hot on the next byte of a
scripted answer (picked from the prompt's text by ``scripted_answer``, then the model's EOS) before
the engine's own sampling runs. Prompt rendering (the byte models' simple template with tools),
tokenising, the engine, detokenising, parsing and streaming are the server's own. In the subprocess
the same function is installed before the CLI's ``main(["serve", ...])`` runs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k3ir.runtime.serve_tools import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    ChatDeltas,
    ToolCallParser,
    forced_call,
    function_name,
)

import k3ir

CALL_TEXT = (f"Checking.{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}{{\"city\": \"Rome\"}}"
             f"{CALL_END}{CALL_BEGIN}functions.get_time:1{ARGUMENT_BEGIN}{{}}{CALL_END}{SECTION_END}")
CALLS = [{"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
         {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
TWO_LAYERS = {"num_hidden_layers": 2}    # k3-tiny cut to 2 layers: ~5x faster steps, same tokenizer
EOS = 257                                   # k3-tiny's end-of-sequence id (a stop id of its byte tokenizer)


def assemble(deltas: list[dict]) -> dict:
    """A chat message from OpenAI streaming deltas, as a client assembles it."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            call = calls.setdefault(c["index"], {"id": None, "type": "function", "function": {"name": None,
                                                                                           "arguments": ""}})
            call["id"] = c.get("id") or call["id"]
            call["function"]["name"] = c.get("function", {}).get("name") or call["function"]["name"]
            call["function"]["arguments"] += c.get("function", {}).get("arguments", "")
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}


# ---- the parser ------------------------------------------------------------------------------------
def test_markup_parses_at_every_split():
    for cut in range(len(CALL_TEXT) + 1):
        d = ChatDeltas(ToolCallParser())
        deltas = d.push(CALL_TEXT[:cut]) + d.push(CALL_TEXT[cut:]) + d.finish()
        assert d.message() == {"role": "assistant", "content": "Checking.", "tool_calls": CALLS}, cut
        assert assemble(deltas) == {"content": "Checking.", "tool_calls": CALLS}, cut


def test_markup_fed_one_character_at_a_time():
    d = ChatDeltas(ToolCallParser())
    deltas = [x for ch in CALL_TEXT for x in d.push(ch)] + d.finish()
    assert assemble(deltas) == {"content": "Checking.", "tool_calls": CALLS}
    starts = [c for x in deltas for c in x.get("tool_calls", []) if "id" in c]
    assert starts == [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}},
                      {"index": 1, "id": "functions.get_time:1", "type": "function",
                       "function": {"name": "get_time", "arguments": ""}}]
    # no marker text leaks into content or arguments, even while it was still arriving
    assert not any("<|" in (x.get("content") or "") for x in deltas)


@pytest.mark.parametrize("text,content,calls", [
    ("plain <| text <|tool_ and more", "plain <| text <|tool_ and more", []),           # no marker completes
    (f"{CALL_BEGIN}f:0{ARGUMENT_BEGIN}{{}}{CALL_END}", "", [("f:0", "f", "{}")]),        # a call without a section
    (f"{SECTION_BEGIN} \n{CALL_BEGIN}x.y.g:3{ARGUMENT_BEGIN}[1]{CALL_END}junk{SECTION_END} after",
     " after", [("x.y.g:3", "g", "[1]")]),
    (f"a{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARGUMENT_BEGIN}{{\"k\": 1", "a",          # cut by max_tokens
     [("functions.f:0", "f", "{\"k\": 1")]),
    (f"a{SECTION_BEGIN}{CALL_BEGIN}functions.f", "a", []),                                 # header unfinished
])
def test_markup_edge_cases(text, content, calls):
    d = ChatDeltas(ToolCallParser())
    d.push(text)
    d.finish()
    got = d.message()
    assert (got["content"] or "") == content
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls", [])] == calls


def test_function_name_rule():
    assert [function_name(x) for x in ("functions.get_weather:0", "get_weather:12", "a.b.c:1", "plain")] == \
        ["get_weather", "get_weather", "c", "plain"]


def test_forced_calls():
    from types import SimpleNamespace
    prefix, parser, opening = forced_call(SimpleNamespace(function=SimpleNamespace(name="get_time")))
    assert prefix == f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_time:0{ARGUMENT_BEGIN}"
    d = ChatDeltas(parser, opening)
    deltas = d.push("{\"tz\": \"UTC\"}" + CALL_END + SECTION_END) + d.finish()
    assert assemble(deltas)["tool_calls"] == [{"id": "functions.get_time:0", "type": "function",
                                               "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]
    prefix, parser, opening = forced_call("required")
    assert prefix == f"{SECTION_BEGIN}{CALL_BEGIN}functions." and opening == []
    d = ChatDeltas(parser)
    d.push("get_weather:0" + ARGUMENT_BEGIN + "{}" + CALL_END)
    d.finish()
    assert d.message()["tool_calls"][0]["id"] == "functions.get_weather:0"


def test_marker_ids_are_shown_other_specials_hidden(tmp_path):
    """With a Kimi tokenizer the markers are control ids: the answer text shows them (decoded with
    skip_special_tokens=False), while <|im_end|> and reserved ids still decode to nothing."""
    pytest.importorskip("tiktoken")
    import base64
    from types import SimpleNamespace

    from k3ir.runtime.serve_stream import TextStream
    from k3ir.runtime.serve_tools import MARKERS
    from k3ir.runtime.tokenizer import load_tokenizer
    names = {2: "<|im_end|>", 7: SECTION_BEGIN, 8: SECTION_END, 9: CALL_BEGIN, 10: ARGUMENT_BEGIN, 11: CALL_END}
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                                                     for b in range(256)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {str(256 + k): {"content": v, "special": True} for k, v in names.items()}}))
    tok = load_tokenizer(str(tmp_path), SimpleNamespace(attrs={"vocab_size": 512}))
    visible = {i: m for m in MARKERS if (i := tok.special_id(m)) is not None}
    assert visible == {263: SECTION_BEGIN, 264: SECTION_END, 265: CALL_BEGIN, 266: ARGUMENT_BEGIN, 267: CALL_END}
    answer = [*b"ok", 263, 265, *b"functions.f:0", 266, *b"{}", 267, 264, 300, 258]     # 300 reserved, 258 im_end
    text = TextStream(tok, [], visible)
    out = "".join(text.push(t) for t in answer) + text.finish()
    assert out == f"ok{SECTION_BEGIN}{CALL_BEGIN}functions.f:0{ARGUMENT_BEGIN}{{}}{CALL_END}{SECTION_END}"
    plain = TextStream(tok, [])
    assert "".join(plain.push(t) for t in answer) + plain.finish() == "okfunctions.f:0{}"


# ---- the server, in process -------------------------------------------------------------------------
def scripted_answer(prompt: str) -> str:
    """The answer forced for a prompt (the byte models' simple template)."""
    if "## Return of functions.get_weather:0\n18C" in prompt:
        return "It is 18C in Rome."
    if prompt.endswith(ARGUMENT_BEGIN):                        # a named tool_choice started the call
        return "{\"city\": \"Oslo\"}" + CALL_END + SECTION_END
    if prompt.endswith(f"{CALL_BEGIN}functions."):             # tool_choice "required"
        return "get_time:0" + ARGUMENT_BEGIN + "{}" + CALL_END + SECTION_END
    if prompt.startswith("tools: "):
        return CALL_TEXT
    return "no tools here"


def install_scripted_sampler() -> None:
    """``Engine._sample`` forced onto ``scripted_answer``'s bytes, then EOS (see the module docstring)."""
    import torch
    from k3ir.runtime import engine
    original = engine.Engine._sample

    def _sample(self, req, row):
        script = [*scripted_answer(bytes(t for t in req.prompt if t < 256).decode()).encode(), EOS]
        forced = torch.full_like(row, float("-inf"))
        forced[script[min(len(req.output), len(script) - 1)]] = 0.0
        original(self, req, forced)
    engine.Engine._sample = _sample


@pytest.fixture(scope="module")
def client():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from k3ir.runtime import engine
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer
    original = engine.Engine._sample
    install_scripted_sampler()
    tiny = k3ir.load("k3-tiny", overrides=TWO_LAYERS)
    eng = engine.build_engine(tiny, block_size=64, num_blocks=32, max_batch=4)
    try:
        with TestClient(create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny",
                                   ServerLimits(max_output_tokens=400))) as c:
            yield c
    finally:
        engine.Engine._sample = original


def chat(client, stream=False, **body):
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 300, **body}
    r = client.post("/v1/chat/completions", content=json.dumps({**body, "stream": stream}),   # ASCII: lone
                    headers={"Content-Type": "application/json"})                             # surrogates too
    if not stream or r.status_code != 200:
        return r
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


def test_auto_tool_calls_whole_and_streamed(client):
    r = chat(client, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Checking.", "tool_calls": CALLS}
    chunks = chat(client, stream=True, tools=TOOLS, tool_choice="auto")
    assert chunks[0]["delta"] == {"role": "assistant"} and chunks[-1]["finish_reason"] == "tool_calls"
    assert assemble([c["delta"] for c in chunks]) == {"content": "Checking.", "tool_calls": CALLS}
    assert sum(1 for c in chunks for t in c["delta"].get("tool_calls", []) if "id" in t) == 2


def test_tool_choice_none_and_no_tools_give_text(client):
    text = chat(client, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert text["message"] == {"role": "assistant", "content": CALL_TEXT} and text["finish_reason"] == "stop"
    plain = chat(client).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no tools here"}


def test_named_and_required_tool_choice(client):
    named = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.json()["choices"][0]["message"]["tool_calls"] == [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]
    chunks = chat(client, stream=True, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert assemble([c["delta"] for c in chunks])["tool_calls"] == named.json()["choices"][0]["message"]["tool_calls"]
    req = chat(client, tools=TOOLS, tool_choice="required").json()["choices"][0]
    assert req["message"]["tool_calls"] == [{"id": "functions.get_time:0", "type": "function",
                                             "function": {"name": "get_time", "arguments": "{}"}}]
    assert req["finish_reason"] == "tool_calls"


def test_second_turn_with_the_tool_result(client):
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"}]
    r = chat(client, tools=TOOLS, messages=messages)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 18C in Rome."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLS}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
                                                                          "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "tool", "tool_call_id": "\ud800", "content": "x"}]}, "messages.0.tool_call_id"),
])
def test_tool_request_errors_name_the_field(client, extra, param):
    r = chat(client, **{"tools": TOOLS, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- a real `k3ir serve` process and the official openai client ------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("openai")
    port = _free_port()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_tool_calls as t; t.install_scripted_sampler(); "
            "from k3ir.cli import main; sys.exit(main(sys.argv[2:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), "serve", "k3-tiny", "--set", "num_hidden_layers=2", "--port",
                             str(port), "--block-size", "64", "--num-blocks", "32", "--max-batch", "2", "--threads", "1",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    import httpx
    t0 = time.time()
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() - t0 < 120, "k3ir serve did not start"
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(30)


def test_two_turn_conversation_through_the_openai_client(served):
    from openai import OpenAI
    client = OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    # turn 1, streamed: the deltas assemble into the two calls
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS, tool_choice="auto",
                                                max_tokens=300, stream=True):
        deltas.append(chunk.choices[0].delta.model_dump(exclude_none=True))
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    assert assemble(deltas) == {"content": "Checking.", "tool_calls": CALLS}
    # turn 1 again, whole: the client's own message object goes back in the next turn
    first = client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS, max_tokens=300)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Rome"}), ("functions.get_time:1", "get_time", {})]
    # turn 2: the assistant's calls and one tool result
    messages += [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18C"},
                 {"role": "tool", "tool_call_id": msg.tool_calls[1].id, "content": "noon"}]
    second = client.chat.completions.create(model="k3-tiny", messages=messages, tools=TOOLS, max_tokens=300)
    assert second.choices[0].message.content == "It is 18C in Rome."
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="k3-tiny", messages=messages, tools=TOOLS, max_tokens=300, stream=True))
    assert streamed == "It is 18C in Rome."
