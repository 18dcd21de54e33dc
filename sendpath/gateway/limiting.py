"""The rate-limit middleware: what each request may cost its key, reserved and settled.

For a generation request, admission reserves ``prompt + n * cap`` tokens:

- the prompt: for a key with token limits (TPM or a daily quota), its exact count from a
  replica's tokenizer (``tokens.ReplicaText.count``: one ``/tokenize`` round trip); else
  the estimate (characters / 4, as OpenAI's limiter does: nothing to protect);
- the answer's cap as the backend will honour it (``context.max_tokens_asked``); a
  request that sets none gets the key's default cap (``keys create --max-tokens``), else
  the gateway's (``--default-max-tokens``), and that cap is sent upstream with the request,
  so nothing generates more than was reserved; under a TPM limit the default cap shrinks
  to what the limit leaves after the prompt, so such a request can still run;
- taken from the daily quota (``KeyStore.reserve_daily``, atomic in SQLite, written with
  the reservations asked meanwhile: ``ledger.UsageLedger.reserve``), then with 1
  request from the per-minute buckets (``ratelimit.py``, atomic in memory or Redis), both
  or neither.

When the response ends, completed, failed or aborted, both are settled with the tokens
really used: the usage the replica reported; else, for a stream, the prompt and the chunks
relayed; for a whole answer whose client left, everything reserved (what the replica did
before it noticed is not known). A request refused before any replica answered it (400
from the input filter, 503 from admission) gets its request back too, so refusals do not
spend a key's RPM. The daily usage is written in batches (``ledger.UsageLedger``). ``GET
/v1/whatif`` (a simulation) spends one request of its key's RPM.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendpath.api.errors import send_error
from sendpath.errors import QuotaExceededError, RateLimitError, SendpathError
from sendpath.gateway.context import GatewayContext, GenerationBody, context, max_tokens_asked
from sendpath.gateway.keys import KeyStore
from sendpath.gateway.ledger import UsageLedger
from sendpath.gateway.middleware import generates, shielded
from sendpath.gateway.ratelimit import Decision, Limits, RateLimiter
from sendpath.gateway.tokens import estimate_prompt_tokens
from sendpath.trace import Stage

__all__ = ["RateLimitMiddleware", "ratelimit_headers"]

REFUSED = frozenset({400, 404, 408, 413, 503})  # refusals that cost no RPM before a replica
_NO_LIMITS = Decision(True, 0.0, None, None, 0.0, 0.0)


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


T = TypeVar("T")


class _Reservation:
    """What one request holds until it settles."""

    def __init__(self, tokens: int, daily: int | None) -> None:
        self.tokens, self.daily = tokens, daily


class RateLimitMiddleware:
    """Daily quota, then requests and tokens per minute for the key (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: RateLimiter,
        keys: KeyStore,
        ledger: UsageLedger,
        default_max_tokens: int,
        count: Callable[[GenerationBody], Awaitable[int]],
    ) -> None:
        self.app, self.limiter, self.keys, self.ledger = app, limiter, keys, ledger
        self.default_max_tokens = default_max_tokens
        self.count = count  # a prompt's exact tokens (a replica's tokenizer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/whatif":
            await self._whatif(scope, receive, send)
            return
        ctx = context(scope) if generates(scope) else None
        if ctx is None or ctx.request is None:
            await self.app(scope, receive, send)
            return
        limits = Limits(ctx.key.rpm, ctx.key.tpm) if ctx.key else Limits(None, None)
        try:
            with ctx.span(Stage.GATEWAY_RATELIMIT):
                reserved, decision = await self._admit(ctx, limits)
        except RateLimitError as exc:
            await send_error(send, exc, exc.headers)
            return
        except SendpathError as exc:
            retry = {"Retry-After": "1"} if exc.status_code == 503 else None
            await send_error(send, exc, retry)
            return
        headers = ratelimit_headers(limits, decision)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        try:  # a key without limits has no headers to add
            await self.app(scope, receive, send_with_headers if headers else send)
        finally:
            if reserved is None:
                pass
            elif limits.rpm is None and limits.tpm is None and reserved.daily is None:
                self._record(ctx, reserved)  # nothing to wait for: settled here and now
            else:
                await shielded(self._settle(ctx, limits, reserved))

    async def _admit(
        self, ctx: GatewayContext, limits: Limits
    ) -> tuple[_Reservation | None, Decision]:
        assert ctx.request is not None
        key = ctx.key
        counted = key is not None and (key.tpm is not None or key.daily_tokens is not None)
        if counted:
            ctx.prompt_tokens = await self.count(ctx.request)
        else:
            ctx.prompt_tokens = estimate_prompt_tokens(ctx.request)
        asked = max_tokens_asked(ctx.request)
        cap = asked
        if asked is None:
            cap = (key.max_tokens if key and key.max_tokens else None) or self.default_max_tokens
            if limits.tpm is not None:
                cap = max(1, min(cap, limits.tpm - ctx.prompt_tokens))
            ctx.default_max_tokens = cap
        assert cap is not None
        want = ctx.prompt_tokens + ctx.request.n * cap  # n answers, if the backend gives n
        if key is None:
            return None, _NO_LIMITS
        daily = None
        if key.daily_tokens is not None:
            daily, left = await self.ledger.reserve(key.name, want, key.daily_tokens)
            if daily is None:
                raise QuotaExceededError(
                    f"The key {key.name!r} has {left} of its daily {key.daily_tokens} tokens "
                    f"left, and this request may use {want} (prompt ~{ctx.prompt_tokens} + "
                    f"max_tokens {cap}). Lower max_tokens; the quota renews at 00:00 UTC (or "
                    "ask the operator to raise it)."
                )
        if limits.rpm is None and limits.tpm is None:  # nothing to reserve: no round trip
            return _Reservation(want, daily), _NO_LIMITS
        try:
            decision = await self._limiter(self.limiter.reserve, key.name, limits, want)
            if not decision.allowed:
                raise self._refusal(ctx, limits, decision, want, asked)
        except BaseException:
            if daily is not None:
                await asyncio.to_thread(self.keys.release, daily)
            raise
        return _Reservation(want, daily), decision

    @staticmethod
    def _refusal(
        ctx: GatewayContext, limits: Limits, decision: Decision, want: int, asked: int | None
    ) -> RateLimitError:
        assert ctx.key is not None
        if math.isinf(decision.retry_after_s):
            return RateLimitError(
                f"This request needs about {want} tokens (prompt ~{ctx.prompt_tokens} + "
                f"max_tokens {asked}), more than the key's limit of {limits.tpm} tokens per "
                "minute; lower max_tokens or shorten the prompt.",
                "tokens",
            )
        kind = "requests" if decision.remaining_requests == 0 and limits.rpm else "tokens"
        limit = limits.rpm if kind == "requests" else limits.tpm
        remaining = decision.remaining_requests if kind == "requests" else decision.remaining_tokens
        retry = str(max(1, math.ceil(decision.retry_after_s)))
        headers = {k.decode(): v.decode() for k, v in ratelimit_headers(limits, decision)}
        return RateLimitError(
            f"Rate limit reached for key {ctx.key.name!r} on {kind} per minute: limit {limit}, "
            f"remaining {remaining}, requested {1 if kind == 'requests' else want}. "
            f"Retry in {decision.retry_after_s:.2f}s.",
            kind,
            {"Retry-After": retry, **headers},
        )

    async def _limiter(self, call: Callable[..., T], *args: Any) -> T:
        """A limiter call: on a worker thread when it waits on the network (Redis)."""
        if self.limiter.blocking:
            return await asyncio.to_thread(call, *args)
        return call(*args)

    @staticmethod
    def _used(ctx: GatewayContext, held: _Reservation) -> tuple[int, bool]:
        """The tokens a finished request used, and whether it was refused before any
        replica answered it (then it costs nothing)."""
        used = ctx.used_tokens()
        if ctx.status == 499 and ctx.usage is None:  # the client left at a replica
            streamed = ctx.body is not None and ctx.body.get("stream") is True
            used = ctx.prompt_tokens + ctx.streamed_chunks if streamed else held.tokens
        refused = not ctx.reached_replica and ctx.status in REFUSED and used == 0
        return used, refused

    def _record(self, ctx: GatewayContext, held: _Reservation) -> None:
        """Settle a key without per-minute limits or a quota: its usage, to the ledger."""
        assert ctx.key is not None
        used, refused = self._used(ctx, held)
        if not refused:
            self.ledger.add(ctx.key.name, used, held.daily)

    async def _settle(self, ctx: GatewayContext, limits: Limits, held: _Reservation) -> None:
        assert ctx.key is not None
        used, refused = self._used(ctx, held)
        if limits.rpm is not None or limits.tpm is not None:
            await self._limiter(
                self.limiter.settle, ctx.key.name, limits, held.tokens, used, refused
            )
        if refused and held.daily is not None:
            await asyncio.to_thread(self.keys.release, held.daily)
        elif not refused:
            self.ledger.add(ctx.key.name, used, held.daily)

    async def _whatif(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A simulation costs CPU, not tokens: one request of the key's RPM."""
        ctx = context(scope)
        if ctx.key is None or ctx.key.rpm is None:
            await self.app(scope, receive, send)
            return
        limits = Limits(ctx.key.rpm, None)
        decision = await self._limiter(self.limiter.reserve, ctx.key.name, limits, 0)
        if not decision.allowed:
            exc = self._refusal(ctx, limits, decision, 0, None)
            await send_error(send, exc, exc.headers)
            return
        await self.app(scope, receive, send)
