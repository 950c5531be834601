"""OpenAI-compatible HTTP API over the serving engine (FastAPI + uvicorn, SSE streaming through
sse-starlette): ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``. Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input (400 malformed or over a limit, 404 unknown model/route, 408 body not received
in time, 413 body too large, however it is sent, 429 too many concurrent requests), also for requests
uvicorn itself refuses (``serve`` runs uvicorn's h11 protocol with a JSON 400). A request field the
server does not read is a 400 naming it (``unknown_parameter``; OpenAI fields it does not implement,
``UNSUPPORTED``, are accepted at their defaults, else ``unsupported_parameter``). A request whose client
disconnects is aborted at once (its slot and pool blocks are freed at the engine's next step).
Binds 127.0.0.1 by default."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request as HTTPRequest

from k3ir.errors import K3Error, K3RuntimeError

from .engine import Engine, EngineThread, Request
from .sampler import SamplingParams
from .tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger("k3ir.server")


@dataclass
class ServerLimits:
    """Per-request and global limits: body bytes (413 over it, chunked bodies too), prompt tokens,
    output tokens (``max_tokens``), requests in flight (queued + running; more get 429), ``stop``
    strings per request and their total characters (400 naming ``stop`` over either), and
    ``body_timeout_s``: seconds from a request's headers until its whole body must have arrived
    (408 and the connection closed otherwise). Each must be an integer >= 1, the timeout a finite
    number > 0 (K3RuntimeError otherwise)."""
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 1024
    max_concurrent: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 4096
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("max_request_bytes", "max_prompt_tokens", "max_output_tokens", "max_concurrent",
                    "max_stop_strings", "max_stop_chars"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise K3RuntimeError(f"server limit {key} must be an integer >= 1, got {v!r}")
        t = self.body_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise K3RuntimeError(f"server limit body_timeout_s must be a finite number of seconds > 0, got {t!r}")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request schemas --------------------------------------------------------------------
#: OpenAI request fields this server does not implement, with the values it accepts for them (their
#: defaults: clients often send those explicitly). Any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, 0, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "stream_options": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}
#: OpenAI fields accepted and ignored without a schema (``user``, which only identifies the end user to
#: the API provider, is a declared field so that its type is checked)
IGNORED: frozenset[str] = frozenset()


class _Common(BaseModel):
    # strict: a wrong JSON type is a 400 naming the field ("2" or true for max_tokens, "yes" for stream),
    # never silently coerced; JSON integers are still accepted for float fields. Extra fields are checked
    # by check_fields (400 naming them).
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None          # accepted and ignored


def check_text(text: str, param: str) -> None:
    """APIError 400 naming ``param`` when ``text`` cannot be encoded as UTF-8 (a lone surrogate such
    as ``"\\ud800"``, which JSON can spell but no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, "
                            "which is not valid Unicode text (send a UTF-8 string)", "invalid_request", param) from None


class CompletionRequest(_Common):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)     # an unknown key in a message is a 400
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)    # OpenAI's newer name for max_tokens


def check_fields(body: _Common) -> None:
    """APIError 400 for a field the request schema does not read: an unsupported OpenAI field
    (UNSUPPORTED) at a value other than its default, or a field the server does not know at all."""
    for key, value in (body.model_extra or {}).items():
        if key in IGNORED:
            continue
        if key in UNSUPPORTED:
            if value in UNSUPPORTED[key]:         # 0.0 == 0 == False: a default in any JSON spelling
                continue
            ok = " or ".join(json.dumps(v) for v in UNSUPPORTED[key])
            raise APIError(400, f"'{key}' is not supported by this server (accepted only as {ok}), got "
                                f"{json.dumps(value)}", "unsupported_parameter", key)
        fields = ", ".join(sorted(type(body).model_fields) + sorted(IGNORED))
        raise APIError(400, f"unrecognized request field '{key}' (this endpoint reads: {fields})",
                       "unknown_parameter", key)


# ---- text with stop strings ---------------------------------------------------------------
class _TextStream:
    """Detokenise incrementally and cut at the first stop string; text that could still start a
    stop string is held back until it cannot."""

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


# ---- the app ---------------------------------------------------------------------------------
class _BodyGuard:
    """ASGI middleware that reads a request's whole body before the app sees it: 413 when it holds
    more than ``limit`` bytes (by Content-Length, or by counting a chunked body), 400 for a
    Content-Length that is not a non-negative integer, 408 when it has not fully arrived ``timeout_s``
    seconds after the headers; these answers close the connection. The app then gets the body as one
    message, and later ``receive`` calls (disconnect detection) go to the server's."""

    def __init__(self, app, limit: int, timeout_s: float):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    @staticmethod
    async def _reject(send, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds {self.limit} bytes"
        cl = dict(scope.get("headers") or []).get(b"content-length")
        if cl is not None:
            if not cl.strip().isdigit():
                return await self._reject(send, 400, f"Content-Length must be a non-negative integer, got "
                                                     f"{cl[:40].decode('latin-1')!r}", "invalid_content_length")
            if len(cl.strip()) > 18 or int(cl) > self.limit:
                return await self._reject(send, 413, too_large, "request_too_large")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks, seen = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await self._reject(send, 408, f"request body not received within {self.timeout_s:g} s "
                                                     f"({seen} bytes arrived)", "request_timeout")
            if msg["type"] == "http.disconnect":          # the client left before its body arrived
                return
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                return await self._reject(send, 413, too_large, "request_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()
        await self.app(scope, replay, send)


async def _abort_on_disconnect(http: HTTPRequest, abort: Callable[[], None]) -> None:
    """Wait for the client of ``http`` to disconnect (its body already read), then call ``abort``."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            abort()
            return


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, limits: ServerLimits | None = None):
    """The FastAPI app serving ``engine`` as ``model_name``. The engine runs in a background thread
    started and stopped with the app's lifespan (use ``with TestClient(app)`` in tests)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from jinja2 import TemplateError
    from sse_starlette.sse import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or ServerLimits()
    runner = EngineThread(engine)
    in_flight = {"n": 0}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="k3ir", lifespan=lifespan)
    app.state.engine, app.state.limits, app.state.runner = engine, limits, runner

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.code, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                           "invalid_request_error", "invalid_json"), status_code=400)
        ctype = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and ctype.split(";")[0].strip().lower() != "application/json":
            # FastAPI reads a body as JSON only under this header (curl -d sends form encoding)
            got = f"got Content-Type '{ctype}'" if ctype else "no Content-Type was sent"
            return JSONResponse(error_body(f"the request body must be a JSON object sent with the header "
                                           f"'Content-Type: application/json' ({got}; with curl: "
                                           f"-H 'Content-Type: application/json')",
                                           "invalid_request_error", "invalid_content_type"), status_code=400)
        if tuple(first.get("loc", ())) == ("body",):      # JSON, but a list / string / number
            return JSONResponse(error_body("the request body must be a JSON object (OpenAI-style fields: "
                                           "{\"prompt\": ..., \"max_tokens\": ...})", "invalid_request_error",
                                           "invalid_request"), status_code=400)
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs[:5])
        return JSONResponse(error_body(msg or "invalid request", "invalid_request_error", "invalid_request", loc),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        cause = exc.__cause__               # FastAPI's "There was an error parsing the body" hides why
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            return JSONResponse(error_body(f"request body is not valid UTF-8 ({cause.reason} at byte {cause.start})",
                                           "invalid_request_error", "invalid_json"), status_code=400)
        if exc.status_code == 400 and isinstance(cause, RecursionError):
            return JSONResponse(error_body("request body is not valid JSON for this server: arrays/objects nested "
                                           "too deeply", "invalid_request_error", "invalid_json"), status_code=400)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", f"http_{exc.status_code}"),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):        # a bug: still a JSON body, never plain text
        log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal server error ({type(exc).__name__})", "server_error",
                                       "internal_error"), status_code=500)

    def params_of(body: _Common, n_prompt: int) -> SamplingParams:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model '{body.model}' does not exist (serving '{model_name}')", "model_not_found", "model")
        if n_prompt > limits.max_prompt_tokens:
            raise APIError(400, f"prompt has {n_prompt} tokens, the limit is {limits.max_prompt_tokens}",
                           "context_length_exceeded", "prompt")
        mt = body.max_tokens if body.max_tokens is not None else min(16, limits.max_output_tokens)
        if mt > limits.max_output_tokens:
            raise APIError(400, f"max_tokens {mt} exceeds the limit {limits.max_output_tokens}",
                           "max_tokens_exceeded", "max_tokens")
        seed = body.seed if body.seed is not None else secrets.randbits(62)
        try:
            return SamplingParams(max_tokens=mt, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  seed=seed, stop_token_ids=list(tokenizer.stop_ids))
        except K3Error as e:
            raise APIError(400, str(e), "invalid_request") from None

    def stops_of(body: _Common) -> list[str]:
        """The request's stop strings; APIError 400 naming ``stop`` over the limits or for text that is
        not valid Unicode."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise APIError(400, f"stop has {len(stops)} strings, the limit is {limits.max_stop_strings}",
                           "invalid_request", "stop")
        total = sum(len(x) for x in stops)
        if total > limits.max_stop_chars:
            raise APIError(400, f"stop strings hold {total} characters in all, the limit is {limits.max_stop_chars}",
                           "invalid_request", "stop")
        for i, x in enumerate(stops):
            check_text(x, "stop" if isinstance(body.stop, str) else f"stop.{i}")
        return stops

    async def run(http: HTTPRequest, ids: list[int], body: _Common, chat: bool):
        sp = params_of(body, len(ids))
        stops = stops_of(body)
        if in_flight["n"] >= limits.max_concurrent:
            raise APIError(429, f"too many concurrent requests (limit {limits.max_concurrent})", "rate_limit_exceeded",
                           kind="rate_limit_error")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(req: Request, tok: int | None) -> None:
            loop.call_soon_threadsafe(q.put_nowait, tok)
        try:
            req = engine.make_request(ids, sp, on_event=on_event)
        except K3Error as e:
            raise APIError(400, str(e), "invalid_request", "prompt") from None
        in_flight["n"] += 1
        runner.submit(req)
        released = []

        def release() -> None:          # once per request: its in-flight slot, and the request if still running
            if not released:
                released.append(True)
                in_flight["n"] -= 1
                if not req.done:
                    runner.abort(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text = _TextStream(tokenizer, stops)
        if body.stream:        # the background task releases a stream the client left before it began
            return EventSourceResponse(stream(req, q, text, rid, chat, release), ping=15,
                                       background=BackgroundTask(release))
        gone = []

        def on_disconnect() -> None:
            gone.append(True)
            release()
        watcher = asyncio.ensure_future(_abort_on_disconnect(http, on_disconnect))
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
        if req.finish_reason == "error":
            raise APIError(500, f"generation failed: {req.error}", "engine_error", kind="server_error")
        text.finish()
        reason = "stop" if text.stopped or req.finish_reason == "stop" else "length"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(req.output),
                 "total_tokens": len(ids) + len(req.output)}
        full = text.text
        choice = ({"index": 0, "message": {"role": "assistant", "content": full}, "finish_reason": reason} if chat
                  else {"index": 0, "text": full, "logprobs": None, "finish_reason": reason})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": usage}

    async def stream(req: Request, q: asyncio.Queue, text: _TextStream, rid: str, chat: bool,
                     release: Callable[[], None]):
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
            reason = "stop" if text.stopped or req.finish_reason == "stop" else "length"
            yield {"data": chunk(delta, reason)}
            yield {"data": "[DONE]"}
        finally:
            release()

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
        return await run(http, ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        check_fields(body)
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise APIError(400, f"max_tokens {body.max_tokens} and max_completion_tokens "
                                    f"{body.max_completion_tokens} disagree (give one)", "invalid_request", "max_tokens")
            body.max_tokens = body.max_completion_tokens
        for i, m in enumerate(body.messages):
            check_text(m.content, f"messages.{i}.content")
        try:
            ids = tokenizer.chat([m.model_dump() for m in body.messages])
        except (TemplateError, TypeError, KeyError, ValueError) as e:   # the checkpoint's template failed
            raise APIError(400, f"chat template failed: {e}", "invalid_request", "messages") from None
        return await run(http, ids, body, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3ir"}]}

    @app.get("/health")
    async def health():
        p = engine.pool
        return {"status": "ok", "model": model_name, "in_flight": in_flight["n"],
                "running": len(engine.running), "waiting": len(engine.waiting),
                "pool": {"blocks": p.num_blocks, "block_size": p.block_size, "free": p.num_free,
                         "cached": p.num_cached, "referenced": p.num_referenced, **p.stats,
                         **engine.block_accounting()},
                "engine": dict(engine.stats)}

    app.add_middleware(_BodyGuard, limit=limits.max_request_bytes, timeout_s=limits.body_timeout_s)
    return app


def json_error_protocol() -> type:
    """uvicorn's h11 HTTP protocol with its 400 for requests it cannot parse (a negative or malformed
    Content-Length, a broken request line or header) answered as an OpenAI-style JSON error instead of
    plain text."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request ({msg.rstrip('.')}: a bad request line, header or "
                                         "Content-Length)", "invalid_request_error", "invalid_http")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
    return JSONErrorH11Protocol


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A ``uvicorn.Server`` for ``app`` on ``host:port`` with JSON 400s for unparsable requests
    (``json_error_protocol``); ``.run()`` serves until interrupted."""
    import uvicorn
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=json_error_protocol()))


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn (``make_server``) until interrupted."""
    make_server(app, host, port, log_level).run()
