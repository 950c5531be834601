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
from .tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    """Detokenise incrementally and cut at the first stop string; text that could still start a
    stop string is held back until it cannot. ``push(token) -> str`` and ``finish() -> str`` return
    the new text; ``text`` is all of it so far (cut at the stop string), ``stopped`` whether a stop
    string was seen."""

    def __init__(self, tok: Tokenizer, stops: list[str]):
        self.dec, self.stops = IncrementalDecoder(tok), [s for s in stops if s]
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


def finish_reason(req: Request, text: TextStream) -> str:
    """OpenAI's ``finish_reason`` of a finished request: ``stop`` (stop token or string) or ``length``."""
    return "stop" if text.stopped or req.finish_reason == "stop" else "length"


async def sse_events(runner: EngineThread, req: Request, q: asyncio.Queue, text: TextStream, rid: str, chat: bool,
                     model_name: str, release: Callable[[], None]) -> AsyncIterator[dict[str, str]]:
    """The server-sent events of a streamed answer: ``{"data": json}`` chunks (chat: ``delta``, the first
    one ``{"role": "assistant"}``; completions: ``text``), the last with its ``finish_reason``, then
    ``[DONE]``; an error object instead when generation fails. Tokens come from ``q`` (None: the request
    finished); ``release`` runs when the stream ends, however it ends."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta:
                d["content"] = delta
            c = {"index": 0, "delta": d, "finish_reason": reason}
        else:
            c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                           "choices": [c]})
    try:
        if chat:
            yield {"data": chunk(None, None, first=True)}
        while (tok := await q.get()) is not None:
            delta = text.push(tok)
            if delta:
                yield {"data": chunk(delta, None)}
            if text.stopped:
                runner.abort(req)
        if req.finish_reason == "error":
            yield {"data": json.dumps(error_body(f"generation failed: {req.error}", "server_error", "engine_error"))}
            return
        delta = text.finish()
        yield {"data": chunk(delta, finish_reason(req, text))}
        yield {"data": "[DONE]"}
    finally:
        release()
