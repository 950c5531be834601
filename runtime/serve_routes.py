"""Routes of the HTTP server: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, over one ``ServingState`` (the engine, its thread, the tokenizer, the limits and the
count of requests in flight)."""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI
from jinja2 import TemplateError
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest

from k3ir.errors import K3Error

from .engine import Engine, EngineThread, Request
from .serve_errors import APIError
from .serve_requests import (
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    ServerLimits,
    check_chat,
    check_fields,
    check_text,
    sampling_params,
    stop_strings,
)
from .serve_stream import SHUTDOWN_MESSAGE, TextStream, abort_on_disconnect, finish_reason, sse_events
from .serve_tools import MARKERS, ChatDeltas, ToolCallParser, forced_call
from .tokenizer import Tokenizer

log = logging.getLogger("k3ir.server")
#: whether this sse-starlette lets a stream finish after the server's exit signal (``shutdown_event``,
#: ``shutdown_grace_period``); older ones end every stream at once
_SSE_DRAINS = "shutdown_grace_period" in inspect.signature(EventSourceResponse.__init__).parameters


@dataclass
class ServingState:
    """What the routes share: the engine and the thread that runs it, the tokenizer, the served model
    name, the limits, ``in_flight`` (requests admitted and not yet released; ``requests`` holds them),
    ``created`` (Unix seconds, for ``/v1/models``) and ``draining`` (set by ``drain``)."""
    engine: Engine
    runner: EngineThread
    tokenizer: Tokenizer
    model_name: str
    limits: ServerLimits
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    requests: set[Request] = field(default_factory=set)
    draining: bool = False

    def drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin a graceful stop (on ``loop``'s thread): requests in flight keep running for
        ``limits.drain_timeout_s`` seconds, then those left are cancelled and answered 503
        ``server_shutdown`` (streams: an error event). Safe to call from a signal handler."""
        def start() -> None:
            if not self.draining:
                self.draining = True
                log.info("draining: %d request(s) in flight get %g s", len(self.requests),
                         self.limits.drain_timeout_s)
                loop.call_later(self.limits.drain_timeout_s, self.cancel_all)
        loop.call_soon_threadsafe(start)

    def cancel_all(self) -> None:
        """Abort every request in flight (the engine finishes each with ``abort`` at its next step)."""
        if self.requests:
            log.warning("drain timeout: cancelling %d request(s)", len(self.requests))
        for req in list(self.requests):
            self.runner.abort(req)


async def generate(state: ServingState, http: HTTPRequest, ids: list[int], body: CommonRequest,
                   answer: ChatDeltas | None = None, visible: dict[int, str] | None = None):
    """Run one request for prompt ``ids``: an ``EventSourceResponse`` when ``body.stream``, else the
    whole answer as a dict (``chat.completion`` when ``answer`` turns the text into chat deltas, else
    ``text_completion``); ``visible``: control ids whose text the answer shows (``TextStream``). APIError
    429 over ``max_concurrent``, 499 when the client left first, 500 when generation failed, 400 for bad
    fields."""
    chat = answer is not None
    limits, runner = state.limits, state.runner
    sp = sampling_params(body, len(ids), state.model_name, limits, list(state.tokenizer.stop_ids))
    stops = stop_strings(body, limits)
    if state.in_flight >= limits.max_concurrent:
        raise APIError(429, f"too many concurrent requests (limit {limits.max_concurrent})", "rate_limit_exceeded",
                       kind="rate_limit_error")
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def on_event(req: Request, tok: int | None) -> None:
        loop.call_soon_threadsafe(q.put_nowait, tok)
    try:
        req = state.engine.make_request(ids, sp, on_event=on_event)
    except K3Error as e:
        raise APIError(400, str(e), "invalid_request", "prompt") from None
    state.in_flight += 1
    state.requests.add(req)
    runner.submit(req)
    released = []

    def release() -> None:          # once per request: its in-flight slot, and the request if still running
        if not released:
            released.append(True)
            state.in_flight -= 1
            state.requests.discard(req)
            if not req.done:
                runner.abort(req)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    text = TextStream(state.tokenizer, stops, visible)
    if body.stream:        # the background task releases a stream the client left before it began
        # on shutdown, sse-starlette (3.x) lets the stream run past the drain timeout, then cancels it
        drain = ({"shutdown_event": anyio.Event(), "shutdown_grace_period": limits.drain_timeout_s + 2}
                 if _SSE_DRAINS else {})
        return EventSourceResponse(sse_events(runner, req, q, text, rid, answer, state.model_name, release,
                                              lambda: state.draining), ping=15, background=BackgroundTask(release),
                                   **drain)
    gone = []

    def on_disconnect() -> None:
        gone.append(True)
        release()
    watcher = asyncio.ensure_future(abort_on_disconnect(http, on_disconnect))
    try:
        while (tok := await q.get()) is not None:
            text.push(tok)
            if text.stopped:
                runner.abort(req)
    finally:
        watcher.cancel()
        release()
    if gone:
        raise APIError(499, "the client closed the connection before the answer was ready", "client_closed")
    if req.finish_reason == "abort" and state.draining:
        raise APIError(503, SHUTDOWN_MESSAGE, "server_shutdown", kind="server_error")
    if req.finish_reason == "error":
        raise APIError(500, f"generation failed: {req.error}", "engine_error", kind="server_error")
    text.finish()
    if chat:
        answer.push(text.text)
        answer.finish()
    reason = finish_reason(req, text, answer)
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(req.output), "total_tokens": len(ids) + len(req.output)}
    choice = ({"index": 0, "message": answer.message(), "finish_reason": reason} if chat
              else {"index": 0, "text": text.text, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice], "usage": usage}


def add_routes(app: FastAPI, state: ServingState) -> None:
    """Register the four endpoints of ``state`` on ``app``."""
    tokenizer = state.tokenizer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_fields(body)
        if isinstance(body.prompt, str):
            check_text(body.prompt, "prompt")
            ids = tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "invalid_request", "prompt")
        return await generate(state, http, ids, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        check_chat(body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice or "auto"
        prefix, parser, opening = "", None, []
        if tools and choice != "none":       # the answer is parsed for calls; "required"/named: one is started
            prefix, parser, opening = ("", ToolCallParser(), []) if choice == "auto" else forced_call(choice)
        try:
            ids = tokenizer.chat(messages, tools, assistant_prefix=prefix)
        except (TemplateError, TypeError, KeyError, ValueError) as e:   # the checkpoint's template failed
            raise APIError(400, f"chat template failed: {e}", "invalid_request", "messages") from None
        visible = {i: m for m in MARKERS if (i := tokenizer.special_id(m)) is not None} if parser else None
        return await generate(state, http, ids, body, ChatDeltas(parser, opening), visible)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "k3ir"}]}

    @app.get("/health")
    async def health():
        engine, p = state.engine, state.engine.pool
        return {"status": "ok", "model": state.model_name, "in_flight": state.in_flight,
                "running": len(engine.running), "waiting": len(engine.waiting),
                "pool": {"blocks": p.num_blocks, "block_size": p.block_size, "free": p.num_free,
                         "cached": p.num_cached, "referenced": p.num_referenced, **p.stats,
                         **engine.block_accounting()},
                "engine": dict(engine.stats)}
