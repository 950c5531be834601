"""ASGI middleware in front of the app: the API key check, and reading each request's whole body within a
size limit and a time limit before the app sees it."""
from __future__ import annotations

import asyncio
import json
import secrets

from .serve_errors import error_body


class BodyGuard:
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


class BearerAuth:
    """ASGI middleware that admits an HTTP request only with the header ``Authorization: Bearer KEY``
    (compared in constant time); paths in ``open_paths`` (``/health``) need none. Others get a 401 JSON
    error (``invalid_api_key``) with ``WWW-Authenticate: Bearer`` before their body is read."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.key, self.open_paths = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        why = "no API key was sent" if not auth else "the API key is not valid"
        body = json.dumps(error_body(f"{why}: send the header 'Authorization: Bearer KEY' with the key the "
                                     "server was started with", "invalid_request_error", "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
