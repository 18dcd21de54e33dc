"""The gateway's pure-ASGI middleware, one concern per class, outermost first:

``TraceMiddleware`` (the request's context and clock) -> ``AuthMiddleware`` (who are you)
-> ``BodyMiddleware`` (read the body once, check it against its endpoint's schema) ->
``RateLimitMiddleware`` (quota, requests and tokens per minute; settles when the response
ends; ``limiting.py``) -> ``SafetyMiddleware`` (the input filter; ``input_filter.py``) ->
``AdmissionMiddleware`` (wait for a slot) -> ``ForwardMiddleware`` (the proxy).

Each one answers with OpenAI's error body itself, before the inner app runs, and each
times its own stage on the context. Only ``/v1/*`` is guarded; ``/health`` is open.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendpath.api.errors import error_response, request_id, send_error
from sendpath.api.json_body import load_json
from sendpath.api.schema import ChatBody, CompletionBody, validate
from sendpath.clock import Clock
from sendpath.errors import AuthenticationError, RequestTooLargeError, SendpathError
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.context import SCOPE_KEY, GatewayContext, GenerationBody, context
from sendpath.gateway.keys import PREFIX, KeyStore
from sendpath.telemetry.genai import operation_of
from sendpath.telemetry.sampling import Sampler
from sendpath.telemetry.trace_context import TraceParent
from sendpath.trace import Stage, TraceStore

__all__ = [
    "AdmissionMiddleware",
    "AuthMiddleware",
    "BodyMiddleware",
    "ForwardMiddleware",
    "TraceMiddleware",
    "cache_salt",
    "generates",
    "live_key",
]

SCHEMAS: dict[str, type[ChatBody] | type[CompletionBody]] = {
    "/v1/chat/completions": ChatBody,
    "/v1/completions": CompletionBody,
}
LARGE_BODY = 256 * 1024  # parsed on a worker thread above this, not on the event loop


def guarded(scope: Scope) -> bool:
    return scope["type"] == "http" and str(scope["path"]).startswith("/v1/")


def generates(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in SCHEMAS


def cache_salt(secret: str) -> str:
    """The prefix-cache salt of a key: 256 bits only its holder (and the gateway) can derive."""
    digest = hashlib.sha256(b"sendpath-cache-salt\0" + secret.encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def live_key(key_name: str | None, client_id: str) -> str:
    """Where a request that names itself is found while it runs: per key, so one key
    cannot see or displace another key's entry by reusing its client id."""
    return f"{key_name or ''}\0{client_id}"


async def shielded(coro: Any) -> None:
    """Run ``coro`` to the end even if the caller is cancelled (settling must not be lost)."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise


class TraceMiddleware:
    """Gives every HTTP request a ``GatewayContext`` with its arrival time, and reports
    each response's status code (``on_status``) for the metrics and the context. A
    generation request is reported again once its response has ended (``on_end``, with
    its GenAI operation); with a ``sampler`` (tracing on), it continues the caller's
    ``traceparent`` (or starts a trace) first."""

    def __init__(
        self,
        app: ASGIApp,
        clock: Clock,
        on_status: Callable[[int], None] = lambda code: None,
        on_end: Callable[[GatewayContext, str], None] = lambda ctx, operation: None,
        sampler: Sampler | None = None,
    ) -> None:
        self.app, self.clock, self.on_status = app, clock, on_status
        self.on_end, self.sampler = on_end, sampler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = GatewayContext(self.clock, self.clock.now(), request_id=request_id(scope))
        scope.setdefault("state", {})[SCOPE_KEY] = ctx
        operation = operation_of(scope["path"])
        if operation is not None and self.sampler is not None:
            given = dict(scope["headers"]).get(b"traceparent")
            parent = TraceParent.parse(given.decode("latin-1") if given else None)
            ctx.trace = self.sampler.start(parent)
            ctx.parent_span_id = parent.span_id if parent is not None else None

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = int(message["status"])
                self.on_status(ctx.status)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if operation is not None:
                self.on_end(ctx, operation)


class AuthMiddleware:
    """``Authorization: Bearer sk-sp-...``: 401 when missing (if required), malformed,
    unknown or revoked. Looked up in the store on every request, so a revocation made by
    any process takes effect on the next request. A request that names itself in
    ``x-sendpath-client-id`` is then findable in ``live`` under its key while it runs (the
    page follows it through the stages with ``GET /v1/progress/{client_id}``)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyStore,
        required: bool,
        per_key_salt: bool,
        live: TraceStore[GatewayContext] | None = None,
    ) -> None:
        self.app, self.keys, self.required, self.per_key_salt = app, keys, required, per_key_salt
        self.live = live

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not guarded(scope):
            await self.app(scope, receive, send)
            return
        ctx = context(scope)
        try:
            with ctx.span(Stage.GATEWAY_AUTH):
                await self._authenticate(scope, ctx)
        except AuthenticationError as exc:
            await send_error(send, exc, {"WWW-Authenticate": "Bearer"})
            return
        client_id = dict(scope["headers"]).get(b"x-sendpath-client-id")
        if client_id is None or self.live is None:
            await self.app(scope, receive, send)
            return
        ctx.client_id = client_id.decode("latin-1")[:64]
        where = live_key(ctx.key.name if ctx.key else None, ctx.client_id)
        self.live.put(where, ctx)
        try:
            await self.app(scope, receive, send)
        finally:
            if self.live.get(where) is ctx:  # a later request may have taken the name
                self.live.pop(where)

    async def _authenticate(self, scope: Scope, ctx: GatewayContext) -> None:
        header = dict(scope["headers"]).get(b"authorization")
        if header is None:
            if not self.required:
                return
            raise AuthenticationError(
                "You didn't provide an API key. Send it in the Authorization header as "
                "'Bearer sk-sp-...' (`sendpath keys create --name NAME` makes one)."
            )
        scheme, _, secret = header.decode("latin-1").strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret.startswith(PREFIX) or " " in secret:
            raise AuthenticationError(
                "Malformed Authorization header: expected 'Bearer sk-sp-...' with a sendpath "
                "API key."
            )
        try:  # on the loop: a WAL read does not wait on writers (keys.py)
            key = self.keys.lookup(secret, wait=False)
        except sqlite3.OperationalError:  # locked all the same (a checkpoint): wait off it
            key = await asyncio.to_thread(self.keys.lookup, secret)
        if key is None:
            raise AuthenticationError(
                f"Incorrect API key provided: {secret[:10]}...{secret[-4:]}. Check the key, or "
                "create one with `sendpath keys create --name NAME`."
            )
        if not key.active:
            raise AuthenticationError(
                f"The API key {key.name!r} has been revoked; ask the operator for a new one."
            )
        ctx.key = key
        if self.per_key_salt:
            ctx.cache_salt = cache_salt(secret)


def parse_body(path: str, raw: bytes) -> tuple[dict[str, Any], GenerationBody]:
    """The body as JSON and as its endpoint's model (``InvalidRequestError`` else)."""
    body = load_json(raw)
    return body, validate(SCHEMAS[path], body)


class BodyMiddleware:
    """Reads a generation request's body once (413 over the limit: at once when its
    Content-Length says so, else as soon as it passes it), checks it against its
    endpoint's schema (400 naming the field: the same check the replica makes), keeps it on
    the context and replays it to the inner app. A large body is parsed on a worker thread."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not generates(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # refused unread
            await send_error(send, RequestTooLargeError(int(declared), self.max_bytes))
            return
        raw = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            more = message.get("more_body", False)
            if len(raw) > self.max_bytes:
                await send_error(send, RequestTooLargeError(len(raw), self.max_bytes))
                return
        ctx, path, data = context(scope), str(scope["path"]), bytes(raw)
        try:
            if len(data) > LARGE_BODY:
                ctx.body, ctx.request = await asyncio.to_thread(parse_body, path, data)
            else:
                ctx.body, ctx.request = parse_body(path, data)
        except SendpathError as exc:
            await send_error(send, exc)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AdmissionMiddleware:
    """Waits for an in-flight slot (fair across keys); 503 + Retry-After when it cannot."""

    def __init__(self, app: ASGIApp, queue: AdmissionQueue, retry_after_s: int) -> None:
        self.app, self.queue, self.retry_after_s = app, queue, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not generates(scope):
            await self.app(scope, receive, send)
            return
        ctx = context(scope)
        try:
            with ctx.span(Stage.GATEWAY_QUEUE):
                await self.queue.acquire(ctx.key.name if ctx.key else "")
        except SendpathError as exc:
            await send_error(send, exc, {"Retry-After": str(self.retry_after_s)})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.queue.release()


class ForwardMiddleware:
    """The innermost layer: a generation request goes straight to the proxy, without the
    app's routing and its per-request wrappers (the app's routes for the two paths are
    there to publish their schema). Errors as the app's handlers would write them."""

    def __init__(
        self,
        app: ASGIApp,
        forward: Callable[[Request], Awaitable[Response]],
        retry_after_s: int,
    ) -> None:
        self.app, self.forward, self.retry_after_s = app, forward, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not generates(scope):
            await self.app(scope, receive, send)
            return
        try:
            response = await self.forward(Request(scope, receive))
        except SendpathError as exc:
            response = error_response(exc, self.retry_after_s)
        await response(scope, receive, send)
