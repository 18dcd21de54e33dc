"""The gateway's pure-ASGI middleware, one concern per class, outermost first:

``TraceMiddleware`` (the request's context and clock) -> ``AuthMiddleware`` (who are you)
-> ``BodyMiddleware`` (read and parse the body once) -> ``RateLimitMiddleware`` (quota,
requests and tokens per minute; settles when the response ends) -> ``SafetyMiddleware``
(the input filter) -> ``AdmissionMiddleware`` (wait for a slot) -> the proxy.

Each one answers with OpenAI's error body itself, before the inner app runs, and each
times its own stage on the context. Only ``/v1/*`` is guarded; ``/health`` is open.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendpath.clock import Clock
from sendpath.errors import (
    AuthenticationError,
    ContentFilterError,
    QuotaExceededError,
    RateLimitError,
    RequestTooLargeError,
    SendpathError,
)
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.context import (
    SCOPE_KEY,
    GatewayContext,
    context,
    estimate_prompt_tokens,
    prompt_text,
    send_error,
)
from sendpath.gateway.keys import PREFIX, KeyStore
from sendpath.gateway.ratelimit import Decision, Limits, RateLimiter
from sendpath.gateway.safety import SafetyCheck
from sendpath.server.protocol import load_json
from sendpath.trace import Stage, TraceStore

__all__ = [
    "AdmissionMiddleware",
    "AuthMiddleware",
    "BodyMiddleware",
    "RateLimitMiddleware",
    "SafetyMiddleware",
    "TraceMiddleware",
]

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")


def _guarded(scope: Scope) -> bool:
    return scope["type"] == "http" and str(scope["path"]).startswith("/v1/")


def _generates(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATE_PATHS


def cache_salt(secret: str) -> str:
    """The prefix-cache salt of a key: 256 bits only its holder (and the gateway) can derive."""
    digest = hashlib.sha256(b"sendpath-cache-salt\0" + secret.encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


async def _shielded(coro: Any) -> None:
    """Run ``coro`` to the end even if the caller is cancelled (settling must not be lost)."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise


class TraceMiddleware:
    """Gives every HTTP request a ``GatewayContext`` with its arrival time, and reports
    each response's status code (``on_status``) for the metrics. A request that names
    itself in ``x-sendpath-client-id`` is findable in ``live`` while it runs (the page
    follows it through the stages with ``GET /v1/progress/{client_id}``)."""

    def __init__(
        self,
        app: ASGIApp,
        clock: Clock,
        on_status: Callable[[int], None] = lambda code: None,
        live: TraceStore[GatewayContext] | None = None,
    ) -> None:
        self.app, self.clock, self.on_status, self.live = app, clock, on_status, live

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = GatewayContext(self.clock, self.clock.now())
        scope.setdefault("state", {})[SCOPE_KEY] = ctx
        client_id = dict(scope["headers"]).get(b"x-sendpath-client-id")
        if client_id is not None and self.live is not None:
            ctx.client_id = client_id.decode("latin-1")[:64]
            self.live.put(ctx.client_id, ctx)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.on_status(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if ctx.client_id is not None and self.live is not None:
                self.live.pop(ctx.client_id)


class AuthMiddleware:
    """``Authorization: Bearer sk-sp-...``: 401 when missing (if required), malformed,
    unknown or revoked. Looked up in the store on every request, so a revocation made by
    any process takes effect on the next request."""

    def __init__(self, app: ASGIApp, keys: KeyStore, required: bool, per_key_salt: bool) -> None:
        self.app, self.keys, self.required, self.per_key_salt = app, keys, required, per_key_salt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _guarded(scope):
            await self.app(scope, receive, send)
            return
        ctx = context(scope)
        try:
            with ctx.span(Stage.GATEWAY_AUTH):
                await self._authenticate(scope, ctx)
        except AuthenticationError as exc:
            await send_error(send, exc, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)

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


class BodyMiddleware:
    """Reads a generation request's body once (413 over the limit, 400 if not a JSON
    object), keeps it parsed on the context and replays it to the inner app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _generates(scope):
            await self.app(scope, receive, send)
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
        try:
            context(scope).body = load_json(bytes(raw))
        except SendpathError as exc:
            await send_error(send, exc)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(raw), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


def ratelimit_headers(limits: Limits, d: Decision) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*`` headers for the limits a key has (none for an unlimited one)."""
    out: list[tuple[str, str]] = []
    for kind, limit, remaining, reset in (
        ("requests", limits.rpm, d.remaining_requests, d.reset_requests_s),
        ("tokens", limits.tpm, d.remaining_tokens, d.reset_tokens_s),
    ):
        if limit is not None:
            out += [
                (f"x-ratelimit-limit-{kind}", str(limit)),
                (f"x-ratelimit-remaining-{kind}", str(remaining or 0)),
                (f"x-ratelimit-reset-{kind}", _duration(reset)),
            ]
    return [(k.encode(), v.encode()) for k, v in out]


class RateLimitMiddleware:
    """Daily quota, then requests and tokens per minute for the key.

    Admission reserves 1 request and ``prompt + max_tokens`` tokens (the prompt estimated
    from its characters; ``default_reserve`` stands in for an absent ``max_tokens``, capped
    at the key's TPM so such a request can still run). When the response ends, completed,
    failed or aborted, the reservation is settled with the tokens really used (refunding
    the rest) and those tokens go to the key's daily ledger.
    """

    def __init__(
        self, app: ASGIApp, limiter: RateLimiter, keys: KeyStore, default_reserve: int
    ) -> None:
        self.app, self.limiter, self.keys = app, limiter, keys
        self.default_reserve = default_reserve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context(scope) if _generates(scope) else None
        if ctx is None or ctx.key is None or ctx.body is None:
            if ctx is not None:  # no key, no limits: the stage still ends here
                ctx.marks[Stage.GATEWAY_RATELIMIT] = ctx.clock.now()
            await self.app(scope, receive, send)
            return
        key, limits = ctx.key, Limits(ctx.key.rpm, ctx.key.tpm)
        try:
            with ctx.span(Stage.GATEWAY_RATELIMIT):
                reserved, decision = await self._admit(ctx, limits)
        except RateLimitError as exc:
            await send_error(send, exc, exc.headers)
            return
        except SendpathError as exc:
            await send_error(send, exc)
            return
        headers = ratelimit_headers(limits, decision)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            used = ctx.used_tokens()
            await _shielded(self._settle(key.name, limits, reserved, used))

    async def _admit(self, ctx: GatewayContext, limits: Limits) -> tuple[int, Decision]:
        assert ctx.key is not None and ctx.body is not None
        key = ctx.key
        if key.daily_tokens is not None:
            used, _ = (await asyncio.to_thread(self.keys.usage, key.name)).get(key.name, (0, 0))
            if used >= key.daily_tokens:
                raise QuotaExceededError(
                    f"The key {key.name!r} has used its daily quota of {key.daily_tokens} "
                    "tokens; it renews at 00:00 UTC (or ask the operator to raise it)."
                )
        ctx.prompt_tokens = estimate_prompt_tokens(ctx.body)
        asked = ctx.body.get("max_completion_tokens", ctx.body.get("max_tokens"))
        asked = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
        reserve = ctx.prompt_tokens + (asked if asked is not None else self.default_reserve)
        if asked is None and limits.tpm is not None:
            reserve = min(reserve, limits.tpm)
        if limits.rpm is None and limits.tpm is None:  # nothing to reserve: no round trip
            return reserve, Decision(True, 0.0, None, None, 0.0, 0.0)
        decision = await asyncio.to_thread(self.limiter.reserve, key.name, limits, reserve)
        if decision.allowed:
            return reserve, decision
        if math.isinf(decision.retry_after_s):
            raise RateLimitError(
                f"This request needs about {reserve} tokens (prompt ~{ctx.prompt_tokens} + "
                f"max_tokens {asked}), more than the key's limit of {limits.tpm} tokens per "
                "minute; lower max_tokens or shorten the prompt.",
                "tokens",
            )
        kind = "requests" if decision.remaining_requests == 0 and limits.rpm else "tokens"
        limit = limits.rpm if kind == "requests" else limits.tpm
        remaining = decision.remaining_requests if kind == "requests" else decision.remaining_tokens
        retry = str(max(1, math.ceil(decision.retry_after_s)))
        headers = {k.decode(): v.decode() for k, v in ratelimit_headers(limits, decision)}
        raise RateLimitError(
            f"Rate limit reached for key {key.name!r} on {kind} per minute: limit {limit}, "
            f"remaining {remaining}, requested {1 if kind == 'requests' else reserve}. "
            f"Retry in {decision.retry_after_s:.2f}s.",
            kind,
            {"Retry-After": retry, **headers},
        )

    async def _settle(self, name: str, limits: Limits, reserved: int, used: int) -> None:
        await asyncio.to_thread(self.limiter.settle, name, limits, reserved, used)
        await asyncio.to_thread(self.keys.record_usage, name, used)


class SafetyMiddleware:
    """The input filter: 400 ``content_filter`` naming the category, before queueing."""

    def __init__(self, app: ASGIApp, check: SafetyCheck) -> None:
        self.app, self.check = app, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context(scope) if _generates(scope) else None
        if ctx is None or ctx.body is None:
            await self.app(scope, receive, send)
            return
        with ctx.span(Stage.GATEWAY_SAFETY):
            category = self.check.check(prompt_text(ctx.body))
        if category is not None:
            param = "prompt" if "prompt" in ctx.body else "messages"
            await send_error(send, ContentFilterError(category, param))
            return
        await self.app(scope, receive, send)


class AdmissionMiddleware:
    """Waits for an in-flight slot (fair across keys); 503 + Retry-After when it cannot."""

    def __init__(self, app: ASGIApp, queue: AdmissionQueue, retry_after_s: int) -> None:
        self.app, self.queue, self.retry_after_s = app, queue, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _generates(scope):
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
