"""Tool calls in chat answers: the Kimi markup a model writes (the markers of the published Kimi chat
template and of vLLM's ``kimi_k2`` tool parser) parsed, token by token, into OpenAI ``tool_calls``::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json arguments}<|tool_call_end|>
    ... more calls ...
    <|tool_calls_section_end|>

The call id is the text between ``<|tool_call_begin|>`` and ``<|tool_call_argument_begin|>``
(``functions.NAME:IDX``, which the template writes back as ``## Return of ID`` in the tool turn); the
function name is its part after the last ``.`` and before the ``:``; the arguments are the raw text up
to ``<|tool_call_end|>`` (not validated: a client parses them). A bare ``<|tool_call_begin|>`` outside a
section opens one too."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("k3ir.server")

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
#: every marker of the markup, as a tokenizer's special tokens may spell them
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
#: the longest a call header (``functions.NAME:IDX``) may grow before the text is given up as no call
MAX_HEADER_CHARS = 512


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` without completing it (text
    that must wait for the next delta before it can be called content)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def function_name(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather`` (vLLM's rule: before the last ``:``, after the last
    ``.``)."""
    return call_id.rsplit(":", 1)[0].rsplit(".", 1)[-1] if ":" in call_id else call_id.rsplit(".", 1)[-1]


class ToolCallParser:
    """Streaming parser of the markup. ``push(text)`` and ``finish()`` return events in order:
    ``("content", text)``, ``("call", index, id, name)`` when a call's header is complete,
    ``("arguments", index, text)`` for each piece of its arguments. ``calls`` holds
    ``{"id", "name", "arguments"}`` per call so far; ``content`` all content text.

    ``state`` and ``pending`` start the parser inside the markup, for an answer whose start the server
    wrote into the prompt: ``"header"`` with ``pending="functions."`` (a call must come), or ``"arguments"``
    after ``open_call(id)`` (this call must come)."""

    def __init__(self, state: str = "content", pending: str = ""):
        self.state, self.buf = state, pending
        self.calls: list[dict[str, str]] = []
        self.content = ""

    def open_call(self, call_id: str) -> tuple:
        """Start a call with header ``call_id``; returns its ``("call", ...)`` event."""
        self.calls.append({"id": call_id, "name": function_name(call_id), "arguments": ""})
        self.state = "arguments"
        i = len(self.calls) - 1
        return ("call", i, call_id, self.calls[i]["name"])

    def _content(self, text: str, out: list) -> None:
        if text:
            self.content += text
            out.append(("content", text))

    def _arguments(self, text: str, out: list) -> None:
        if text:
            self.calls[-1]["arguments"] += text
            out.append(("arguments", len(self.calls) - 1, text))

    def push(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        """Consume what can be consumed of ``buf`` in the current state; True when the state changed."""
        buf = self.buf
        if self.state == "content":
            hits = [(i, m) for m in (SECTION_BEGIN, CALL_BEGIN) if (i := buf.find(m)) >= 0]
            if not hits:
                keep = held_back(buf, (SECTION_BEGIN, CALL_BEGIN))
                self._content(buf[:len(buf) - keep], out)
                self.buf = buf[len(buf) - keep:]
                return False
            i, m = min(hits)
            self._content(buf[:i], out)
            self.buf, self.state = buf[i + len(m):], "section" if m == SECTION_BEGIN else "header"
            return True
        if self.state == "section":
            s = buf.lstrip()
            for m, state in ((CALL_BEGIN, "header"), (SECTION_END, "content")):
                if s.startswith(m):
                    self.buf, self.state = s[len(m):], state
                    return True
            if any(m.startswith(s) for m in (CALL_BEGIN, SECTION_END)):
                self.buf = s                      # a marker may still be arriving
                return False
            j = s.find("<|", 1)                   # text between calls: not part of any call
            self.buf = s[j:] if j >= 0 else ""
            return j >= 0
        if self.state == "header":
            i = buf.find(ARGUMENT_BEGIN)
            if i < 0:
                if len(buf) > MAX_HEADER_CHARS:
                    log.warning("tool call header longer than %d characters: given up as content", MAX_HEADER_CHARS)
                    self.buf, self.state = "", "content"
                    self._content(CALL_BEGIN + buf, out)
                return False
            out.append(self.open_call(buf[:i].strip()))
            self.buf = buf[i + len(ARGUMENT_BEGIN):]
            return True
        i = buf.find(CALL_END)                    # state "arguments"
        if i < 0:
            keep = held_back(buf, (CALL_END,))
            self._arguments(buf[:len(buf) - keep], out)
            self.buf = buf[len(buf) - keep:]
            return False
        self._arguments(buf[:i], out)
        self.buf, self.state = buf[i + len(CALL_END):], "section"
        return True

    def finish(self) -> list[tuple]:
        """Events for what is left at the end of the answer: held-back text as content (or arguments of
        an unfinished call); an unfinished header is dropped."""
        out: list[tuple] = []
        if self.state == "content":
            self._content(self.buf, out)
        elif self.state == "arguments":
            self._arguments(self.buf, out)
        elif self.state == "header" and self.buf.strip():
            log.warning("answer ended inside a tool call header %r: dropped", self.buf[:80])
        self.buf = ""
        return out


def forced_call(tool_choice: Any) -> tuple[str, ToolCallParser, list[tuple]]:
    """For ``tool_choice`` ``"required"`` or a named function (an object with ``.function.name``): the
    markup the server appends to the prompt, so that the model's answer continues inside a call, the
    parser that starts there and its first events (the named call, opened)."""
    if tool_choice == "required":
        return SECTION_BEGIN + CALL_BEGIN + "functions.", ToolCallParser("header", "functions."), []
    call_id = f"functions.{tool_choice.function.name}:0"
    parser = ToolCallParser()
    return SECTION_BEGIN + CALL_BEGIN + call_id + ARGUMENT_BEGIN, parser, [parser.open_call(call_id)]


class ChatDeltas:
    """Text of a chat answer as OpenAI ``delta`` dicts: ``{"content": ...}``, or with a ``parser``,
    content and ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` (the
    first delta of a call carries its id and name, later ones pieces of its arguments)."""

    def __init__(self, parser: ToolCallParser | None = None, opening: list[tuple] | None = None):
        self.parser, self.content, self._opening = parser, "", list(opening or [])

    @property
    def calls(self) -> list[dict[str, str]]:
        return self.parser.calls if self.parser is not None else []

    def _deltas(self, events: list[tuple]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if ev[0] == "content":
                if out and "content" in out[-1]:
                    out[-1]["content"] += ev[1]
                else:
                    out.append({"content": ev[1]})
            elif ev[0] == "call":
                out.append({"tool_calls": [{"index": ev[1], "id": ev[2], "type": "function",
                                            "function": {"name": ev[3], "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            self.content += text
            return [{"content": text}] if text else []
        events, self._opening = self._opening + self.parser.push(text), []
        out = self._deltas(events)
        self.content = self.parser.content
        return out

    def finish(self) -> list[dict[str, Any]]:
        if self.parser is None:
            return []
        out = self._deltas(self._opening + self.parser.finish())
        self._opening, self.content = [], self.parser.content
        return out

    def message(self) -> dict[str, Any]:
        """The whole answer as a ``chat.completion`` message (content None when there are calls and no text)."""
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls]
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        return msg
