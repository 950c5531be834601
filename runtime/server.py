"""OpenAI-compatible HTTP API over the serving engine (FastAPI + uvicorn, SSE streaming through
sse-starlette): ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text format, ``runtime.metrics``). Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input (400 malformed or over a limit, 404 unknown model/route, 408 body not received
in time, 413 body too large, however it is sent, 429 too many concurrent requests), also for requests
uvicorn itself refuses (``serve`` runs uvicorn's h11 protocol with a JSON 400). A request field the
server does not read is a 400 naming it (``unknown_parameter``; OpenAI fields it does not implement,
``UNSUPPORTED``, are accepted at their defaults, else ``unsupported_parameter``). A request whose client
disconnects is aborted at once (its slot and pool blocks are freed at the engine's next step).
Binds 127.0.0.1 by default. With an API key, every path but ``/health`` needs ``Authorization: Bearer KEY``
(401 otherwise). SIGTERM (or Ctrl-C) drains: no new connections, requests in flight get
``ServerLimits.drain_timeout_s`` to finish, those left are cancelled (503 / an error event), and
``serve`` returns (``k3ir serve`` exits 0).

The parts: ``serve_requests`` (request models, limits, validation), ``serve_errors`` (JSON errors),
``serve_guard`` (the API key, the body size and time limits), ``serve_routes`` (the endpoints), ``serve_stream``
(answer text and server-sent events). This module assembles them."""
from __future__ import annotations

import asyncio
import dataclasses
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import Response

from k3ir.errors import K3RuntimeError

from .engine import Engine, EngineThread
from .metrics import EngineMetrics
from .serve_errors import APIError, add_error_handlers, error_body, json_error_protocol
from .serve_guard import BearerAuth, BodyGuard
from .serve_requests import (
    UNSUPPORTED,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ServerLimits,
    check_fields,
    check_text,
)
from .serve_routes import ServingState, add_routes
from .tokenizer import Tokenizer

__all__ = [
    "UNSUPPORTED",
    "APIError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ServerLimits",
    "check_fields",
    "check_text",
    "create_app",
    "error_body",
    "json_error_protocol",
    "make_server",
    "serve",
]


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, limits: ServerLimits | None = None,
               api_key: str | None = None, runner: EngineThread | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``. The engine runs in a background thread
    started and stopped with the app's lifespan (use ``with TestClient(app)`` in tests). ``api_key``:
    the bearer token every request but ``GET /health`` must carry (None: no check); K3RuntimeError when
    it is empty. ``runner``: the thread that runs the engine (default ``EngineThread(engine)``; on a mesh
    rank 0's ``serve_mesh.MeshEngineThread``)."""
    if api_key is not None and not api_key.strip():
        raise K3RuntimeError("the API key must not be empty (leave it out to serve without one)")
    limits = limits or ServerLimits()
    if limits.max_prompt_tokens is None:
        limits = dataclasses.replace(limits, max_prompt_tokens=engine.prompt_limit())
    state = ServingState(engine=engine, runner=runner or EngineThread(engine), tokenizer=tokenizer, model_name=model_name,
                         limits=limits)

    @asynccontextmanager
    async def lifespan(app):
        state.runner.start()
        try:
            yield
        finally:
            state.runner.stop()

    app = FastAPI(title="k3ir", lifespan=lifespan)
    app.state.engine, app.state.limits, app.state.runner, app.state.serving = engine, limits, state.runner, state
    add_error_handlers(app)
    add_routes(app, state)
    metrics = app.state.metrics = EngineMetrics(engine).attach()

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)
    app.add_middleware(BodyGuard, limit=limits.max_request_bytes, timeout_s=limits.body_timeout_s)
    if api_key is not None:                 # added last: the outermost, so a body is read only once admitted
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose exit signal starts the app's drain (``ServingState.drain``) and gives
        in-flight requests the drain timeout before uvicorn cancels what is left; a SIGTERM that ends in
        a drained shutdown is not re-raised, so the process exits normally."""

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            state = getattr(getattr(self.config.app, "state", None), "serving", None)
            if state is not None and getattr(self, "loop", None) is not None:
                state.drain(self.loop)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()
    return DrainingServer


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A ``uvicorn.Server`` for ``app`` on ``host:port`` with JSON 400s for unparsable requests
    (``json_error_protocol``) and a drain on SIGTERM / Ctrl-C (see the module docstring); ``.run()``
    serves until then."""
    import uvicorn
    limits = getattr(getattr(app, "state", None), "limits", None) or ServerLimits()
    return _draining_server_class()(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                   http=json_error_protocol(),
                                                   timeout_graceful_shutdown=limits.drain_timeout_s + 5))


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn (``make_server``) until interrupted."""
    make_server(app, host, port, log_level).run()
