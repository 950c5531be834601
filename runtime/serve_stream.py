"""Answer text of the HTTP server: incremental detokenisation cut at stop strings, the server-sent
events of a streamed answer, and disconnect watching."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HTTPRequest

from .engine import EngineThread, Request
from .serve_errors import error_body
from .serve_tools import ChatDeltas
from .tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    """Detokenise incrementally and cut at the first stop string; text that could still start a
    stop string is held back until it cannot. ``push(token) -> str`` and ``finish() -> str`` return
    the new text; ``text`` is all of it so far (cut at the stop string), ``stopped`` whether a stop
    string was seen. ``visible``: control ids decoded to their text (``decode(..., skip_special_tokens=False)``)
    where the tokenizer skips other special ids, e.g. the tool-call markers."""

    def __init__(self, tok: Tokenizer, stops: list[str], visible: dict[int, str] | None = None):
        self.tok, self.dec, self.stops = tok, IncrementalDecoder(tok), [s for s in stops if s]
        self.visible = visible or {}
        self.text, self.sent, self.stopped = "", 0, False
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def _emit(self, final: bool) -> str:
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped, final = self.text[:min(hits)], True, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        if token in self.visible:
            self.text += self.dec.flush() + self.visible[token]
            self.dec = IncrementalDecoder(self.tok)
        else:
            self.text += self.dec.push(token)
        return self._emit(False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.dec.flush()
        return self._emit(True)


async def abort_on_disconnect(http: HTTPRequest, abort: Callable[[], None]) -> None:
    """Wait for the client of ``http`` to disconnect (its body already read), then call ``abort``."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            abort()
            return


#: the answer to a request cancelled because the server stopped before it finished
SHUTDOWN_MESSAGE = "the server is shutting down: the request was cancelled after the drain timeout"


def finish_reason(req: Request, text: TextStream, answer: ChatDeltas | None = None) -> str:
    """OpenAI's ``finish_reason`` of a finished request: ``length`` (``max_tokens`` reached), else
    ``tool_calls`` when the answer holds calls, else ``stop`` (stop token or string)."""
    if not (text.stopped or req.finish_reason == "stop"):
        return "length"
    return "tool_calls" if answer is not None and answer.calls else "stop"


async def sse_events(runner: EngineThread, req: Request, q: asyncio.Queue, text: TextStream, rid: str,
                     answer: ChatDeltas | None, model_name: str,
                     release: Callable[[], None],
                     draining: Callable[[], bool] = lambda: False) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of a streamed answer: ``{"data": json}`` chunks (chat, ``answer`` given:
    ``delta``, the first one ``{"role": "assistant"}``, then content and ``tool_calls`` deltas;
    completions: ``text``), the last with its ``finish_reason``, then ``[DONE]``; an error object
    instead when generation fails or the server's drain cancelled it (``draining()``). Tokens come from ``q`` (None: the request finished); ``release`` runs
    when the stream ends, however it ends."""
    chat = answer is not None
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict[str, Any] | str, reason: str | None) -> str:
        c = ({"index": 0, "delta": delta, "finish_reason": reason} if chat
             else {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason})
        return json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                           "choices": [c]})

    def deltas(piece: str) -> list[dict[str, Any]] | list[str]:
        if not chat:
            return [piece] if piece else []
        return answer.push(piece)
    try:
        if chat:
            yield {"data": chunk({"role": "assistant"}, None)}
            for d in answer.push(""):                  # a forced call opens before any token
                yield {"data": chunk(d, None)}
        while (tok := await q.get()) is not None:
            for d in deltas(text.push(tok)):
                yield {"data": chunk(d, None)}
            if text.stopped:
                runner.abort(req)
        if req.finish_reason == "error":
            yield {"data": json.dumps(error_body(f"generation failed: {req.error}", "server_error", "engine_error"))}
            return
        if req.finish_reason == "abort" and draining():
            yield {"data": json.dumps(error_body(SHUTDOWN_MESSAGE, "server_error", "server_shutdown"))}
            return
        last = deltas(text.finish()) + (answer.finish() if chat else [])
        for d in last[:-1]:
            yield {"data": chunk(d, None)}
        yield {"data": chunk(last[-1] if last else ({} if chat else ""), finish_reason(req, text, answer))}
        yield {"data": "[DONE]"}
    finally:
        release()
