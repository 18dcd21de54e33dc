"""Errors as both apps answer them: OpenAI's shape, a request id, no internals.

``RequestIdMiddleware`` gives every HTTP request an id (``req_<32 hex>``), kept in the
ASGI scope and sent back as ``x-request-id`` unless the app set its own (a completion's
``chatcmpl-...`` id). ``install_error_handlers`` makes every error an OpenAI error body:
``SendpathError`` as it says (503s with ``Retry-After``), Starlette's 404 / 405 and
FastAPI's parameter errors (as 400), anything else as a 500 naming the request id, its
exception and traceback only in the server's log (``internal_error``; also sent by
``InternalErrorMiddleware`` for middleware that runs outside FastAPI's handlers).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendpath.errors import InternalServerError, InvalidRequestError, SendpathError

__all__ = [
    "InternalErrorMiddleware",
    "RequestIdMiddleware",
    "error_body",
    "error_response",
    "install_error_handlers",
    "internal_error",
    "request_id",
    "send_error",
]

logger = logging.getLogger("sendpath.http")
_SCOPE_KEY = "sendpath.request_id"


def error_body(exc: SendpathError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }


def request_id(scope: MutableMapping[str, Any]) -> str:
    """This request's id (made by ``RequestIdMiddleware``; one is made here if it did not run)."""
    state = scope.setdefault("state", {})
    if _SCOPE_KEY not in state:
        state[_SCOPE_KEY] = f"req_{os.urandom(16).hex()}"  # uuid4 costs 4x as much
    rid: str = state[_SCOPE_KEY]
    return rid


class RequestIdMiddleware:
    """Names each HTTP request and says its name in ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope).encode()

        async def named_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, named_send)


def error_response(exc: SendpathError, retry_after_s: int) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 503:
        headers.setdefault("Retry-After", str(retry_after_s))
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers or None)


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """OpenAI error bodies for every error a route raises (see the module docstring)."""

    @app.exception_handler(SendpathError)
    async def sendpath_error(request: Request, exc: SendpathError) -> JSONResponse:
        return error_response(exc, retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own 404 (no such path) and 405 (wrong method), in OpenAI's shape."""
        error = SendpathError(f"{exc.detail}: {request.method} {request.url.path}")
        error.type = "invalid_request_error"
        error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error.status_code = exc.status_code
        return JSONResponse(error_body(error), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A query or path parameter of the wrong type (400, naming it)."""
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")]
        param = ".".join(where) or None
        error = InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'not valid')}.", param=param
        )
        return JSONResponse(error_body(error), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request.scope, exc)


def internal_error(scope: MutableMapping[str, Any], exc: Exception) -> JSONResponse:
    """The 500 for an exception no handler expected: the request id, not the exception
    (that goes to the log; the server logs the traceback after this)."""
    rid = request_id(scope)
    logger.error("request %s failed: %s: %s", rid, type(exc).__name__, exc)
    response = error_response(InternalServerError(rid), 0)
    response.headers["x-request-id"] = rid  # sent from outside the id middleware
    return response


class InternalErrorMiddleware:
    """The outermost layer where an app's own middleware runs outside FastAPI's error
    handling (the gateway's): an exception is ``internal_error``'s 500 if nothing was sent
    yet, and is raised on for the server's log, as FastAPI's ``ServerErrorMiddleware``
    does with the ``Exception`` handler ``install_error_handlers`` installs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def noting_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        except Exception as exc:
            if not started:
                await internal_error(scope, exc)(scope, receive, send)
            raise


async def send_error(send: Send, exc: SendpathError, headers: dict[str, str] | None = None) -> None:
    """Answer with OpenAI's error body from ASGI middleware (before any byte was sent)."""
    body = json.dumps(error_body(exc)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": raw})
    await send({"type": "http.response.body", "body": body})
