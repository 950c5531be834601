"""OpenAI-style JSON errors of the HTTP server: ``APIError`` (raised by request handling), the error
body ``{"error": {"message", "type", "param", "code"}}``, the FastAPI exception handlers that answer
every failure with such a body (validation errors, bodies that are not JSON objects or not sent as
``application/json``, bodies that are not UTF-8, unknown routes, bugs as 500) and uvicorn's h11
protocol with its own 400s as JSON."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

log = logging.getLogger("k3ir.server")


class APIError(Exception):
    """A request the server answers with ``status`` and an OpenAI-style error body: ``message``,
    ``code`` (machine-readable), ``param`` (the request field at fault, or None), ``kind`` (the
    body's ``type``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _bad_request(message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", code, param), status_code=400)


async def _api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.code, exc.param), status_code=exc.status)


async def _invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        return _bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", "invalid_json")
    ctype = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and ctype.split(";")[0].strip().lower() != "application/json":
        # FastAPI reads a body as JSON only under this header (curl -d sends form encoding)
        got = f"got Content-Type '{ctype}'" if ctype else "no Content-Type was sent"
        return _bad_request(f"the request body must be a JSON object sent with the header "
                            f"'Content-Type: application/json' ({got}; with curl: "
                            f"-H 'Content-Type: application/json')", "invalid_content_type")
    if tuple(first.get("loc", ())) == ("body",):      # JSON, but a list / string / number
        return _bad_request("the request body must be a JSON object (OpenAI-style fields: "
                            "{\"prompt\": ..., \"max_tokens\": ...})", "invalid_request")
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs[:5])
    return _bad_request(msg or "invalid request", "invalid_request", loc)


async def _http(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    cause = exc.__cause__               # FastAPI's "There was an error parsing the body" hides why
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return _bad_request(f"request body is not valid UTF-8 ({cause.reason} at byte {cause.start})", "invalid_json")
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return _bad_request("request body is not valid JSON for this server: arrays/objects nested too deeply",
                            "invalid_json")
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error", f"http_{exc.status_code}"),
                        status_code=exc.status_code)


async def _unexpected(request: HTTPRequest, exc: Exception) -> JSONResponse:    # a bug: JSON too, never plain text
    log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal server error ({type(exc).__name__})", "server_error", "internal_error"),
                        status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with an OpenAI-style JSON body (see the module docstring)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)


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
