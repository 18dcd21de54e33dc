"""Forwarding a generation request to a replica, with retries and timeouts.

The body goes on as the gateway checked it (the fields of its schema, as the client set
them; fields the schema does not know are not passed on), with three changes: under
per-key isolation the key's ``cache_salt`` replaces any the client set; a request that
set no answer cap gets the one admission reserved (``max_tokens``, marked
``x-sendpath-max-tokens: default`` so our replica still stops at the context's end rather
than refusing); and a stream always asks the replica for usage
(``stream_options.include_usage``) so the rate limiter can settle with real numbers.

Until the first token exists nothing has reached the client, so a failing replica only
means trying another (each at most once, within ``retry_deadline_s``): it did not connect
within ``connect_s``, answered 5xx or "busy", sent an error as its first event (a 200
whose stream opens with an error is that error, with its status), produced no first
token within ``first_token_s``, or its health check says its engine is stuck (504 if no
replica answers). After a timeout or a stuck replica the next replica is tried even past
the retry window (the wait was the replica's, and each is tried once). A failure the
request itself caused is never retried: any 4xx, and ``request_failed`` (the engine
stopped that request alone). One try is ``attempt.Attempt``, which returns what it got
as plain data; the proxy decides (``verdict``), and after a stream's first token hands it
to ``relay.StreamRelay``. What the answer brings is recorded in one place,
``outcome.Outcome``; whole and streamed answers pass the same output filter
(``output_filter.ChoiceFilter``).

If the client leaves while its request is at a replica (a stream before its first token,
or a whole answer at any time: a replica sends a whole answer's headers only when it is
done), the upstream connection is closed at once, which aborts the request there.
Clients never see a replica's address: answers name it (``x-sendpath-replica``) by its
name, and an upstream 5xx whose body is not one of our known errors is replaced by ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sendpath.api.disconnect import ClientWatch, signal_of
from sendpath.api.errors import error_body
from sendpath.api.prompt import GenerationBody, route_text
from sendpath.api.schema import DEFAULT_CAP_HEADER, ChatBody, CompletionBody
from sendpath.api.sse import EventStreamResponse
from sendpath.errors import SendpathError, ServiceUnavailableError
from sendpath.gateway.attempt import Attempt, Exchange, Failed, Gone, Head, Refused, Whole
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.outcome import Outcome
from sendpath.gateway.output_filter import ChoiceFilter
from sendpath.gateway.relay import StreamRelay
from sendpath.gateway.safety import OutputGuard
from sendpath.gateway.upstream import UpstreamClient
from sendpath.gateway.verdict import Verdict, error_code, verdict
from sendpath.router.route import RouteRequest
from sendpath.router.router import Router
from sendpath.trace import server_timing

__all__ = ["Proxy", "ProxyTimeouts", "Retry", "UpstreamTimeoutError", "route_request"]

logger = logging.getLogger("sendpath.gateway")


# Error codes whose bodies pass through as the replica wrote them (ours: no internals).
_KNOWN_CODES = frozenset(
    {"queue_full", "service_unavailable", "request_failed", "internal_error", "model_not_found"}
)


class UpstreamTimeoutError(SendpathError):
    """No replica produced a first token in time (HTTP 504)."""

    type = "timeout"
    code = "upstream_timeout"
    status_code = 504


class UpstreamError(SendpathError):
    """A replica answered with a server error we do not know (HTTP 502)."""

    type = "server_error"
    code = "upstream_error"
    status_code = 502


@dataclass
class Retry:
    """An attempt that did not answer: try another replica, else hand back ``response``
    (``late``: the replica timed out or got stuck, so try another even past the window)."""

    response: Response | None = None
    late: bool = False


@dataclass(frozen=True)
class ProxyTimeouts:
    """How long the gateway waits on a replica (seconds)."""

    connect_s: float = 5.0
    first_token_s: float = 120.0  # a stream's first token (queue + prefill at the replica)
    between_tokens_s: float = 60.0
    whole_answer_s: float = 600.0  # a non-streamed answer, in full
    retry_deadline_s: float = 30.0  # retries (before the first token) stop after this


# An idle pooled connection is dropped after this: before the replica's own keep-alive
# bound (uvicorn's 5 s) closes it under a request (a POST is not sent twice)
KEEPALIVE_S = 4.0


def upstream_body(ctx: GatewayContext) -> tuple[dict[str, Any], dict[str, str], bool]:
    """The body and extra headers a replica gets (module docstring), and whether the
    client asked for the usage chunk."""
    assert ctx.request is not None
    body = ctx.request.model_dump(exclude_unset=True, by_alias=True)  # the wire names
    headers: dict[str, str] = {}
    if ctx.cache_salt is not None:
        body["cache_salt"] = ctx.cache_salt
    if ctx.default_max_tokens is not None:
        body["max_tokens"] = ctx.default_max_tokens
        headers[DEFAULT_CAP_HEADER] = "default"
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    wants_usage = options.get("include_usage") is True
    if body.get("stream") is True:
        body["stream_options"] = {**options, "include_usage": True}
    return body, headers, wants_usage


class Proxy:
    """Sends requests to replicas over one pooled HTTP client (module docstring).

    The client is ``upstream.UpstreamClient`` (its own, on httptools: aiohttp's
    request machinery cost more per request, ``benchmarks/gateway_overhead.py``)."""

    def __init__(
        self,
        router: Router,
        client: UpstreamClient,
        guard: Callable[[], OutputGuard] | None,
        timeouts: ProxyTimeouts,
        done: Callable[[GatewayContext], None],
        tokenize: Callable[[GenerationBody], Awaitable[list[int] | None]] | None = None,
    ) -> None:
        self.router = router
        self.client = client  # pooled (each replica's key goes per request); closed here
        self.guard = guard
        self.timeouts = timeouts
        self.done = done  # a request finished: record its trace and metrics
        # a prompt's token ids from a replica, for precise prefix routing (None: not asked)
        self.tokenize = tokenize

    async def aclose(self) -> None:
        await self.client.aclose()

    async def forward(self, request: Request) -> Response:
        """Forward one POST to ``/v1/chat/completions`` or ``/v1/completions``."""
        watch = ClientWatch(request.receive, signal_of(request.scope))
        try:
            response = await self._forward(request, watch)
        except BaseException:
            watch.close()
            raise
        if not isinstance(response, EventStreamResponse):  # else it watches to the end
            watch.close()
        return response

    async def _forward(self, request: Request, watch: ClientWatch) -> Response:
        """Each replica in turn until one answers (module docstring)."""
        ctx = context(request.scope)
        assert ctx.request is not None
        body, headers, wants_usage = upstream_body(ctx)
        salt = body.get("cache_salt")  # the key's, or the client's where keys share a cache
        route = route_request(ctx.request, salt if isinstance(salt, str) else None)
        if self.tokenize is not None and any(e.events for e in self.router.pool.endpoints):
            ids = await self.tokenize(ctx.request)  # one /tokenize round trip
            if ids is not None:
                route = replace(route, token_ids=tuple(ids))
        outcome = Outcome(ctx, self.router, route, self.done)
        streaming = body.get("stream") is True
        timeouts = self.timeouts
        limit = timeouts.first_token_s if streaming else timeouts.whole_answer_s
        raw = json.dumps(body).encode()
        path = request.scope["path"]
        deadline = ctx.clock.now() + timeouts.retry_deadline_s
        tried: set[int] = set()
        fallback: Response | None = None
        late = False
        while not tried or late or ctx.clock.now() < deadline:
            chosen = self.router.route(route, tried)
            if chosen is None:
                break
            endpoint, prediction = chosen
            tried.add(endpoint.index)
            traced = outcome.tried(endpoint, prediction)
            attempt = Attempt(
                self.client,
                outcome,
                endpoint,
                path,
                raw,
                {**headers, **traced} if traced else headers,
                streaming,
                limit,
                watch,
            )
            answer = self._answer(outcome, await attempt.run(), watch, wants_usage)
            if not isinstance(answer, Retry):
                answer.headers["x-sendpath-replica"] = endpoint.name
                return answer
            fallback, late = answer.response or fallback, answer.late
        if fallback is not None:
            return fallback
        raise ServiceUnavailableError(
            "No healthy replica could take the request"
            + (f" (tried {len(tried)})" if tried else "")
            + "; retry in a moment."
        )

    def _answer(
        self, outcome: Outcome, exchange: Exchange, watch: ClientWatch, wants_usage: bool
    ) -> Response | Retry:
        """What one attempt's exchange means for the request: the client's response, or
        a retry elsewhere."""
        match exchange:
            case Gone():
                return Response(status_code=499)
            case Failed(why=why, late=late):
                outcome.failed(why)
                return Retry(self._timed_out(outcome, why) if late else None, late)
            case Refused():
                return self._refused(outcome, exchange)
            case Whole(data=data, headers=headers):
                outcome.started()
                return self._whole(outcome, data, headers)
            case Head():
                outcome.started()
                ctx = outcome.ctx
                assert ctx.request is not None
                relay = StreamRelay(
                    outcome,
                    exchange,
                    ChoiceFilter(self.guard) if self.guard is not None else None,
                    ctx.request.n,
                    wants_usage,
                    self.timeouts.between_tokens_s,
                )
                return EventStreamResponse(relay.events(), watch, exchange.headers)
        raise AssertionError(exchange)

    def _refused(self, outcome: Outcome, refused: Refused) -> Response | Retry:
        """A replica's error answer: final, or a retry elsewhere (``verdict.py``)."""
        ctx, endpoint = outcome.ctx, outcome.endpoint
        assert endpoint is not None
        status, raw, headers = refused.status, refused.raw, refused.headers
        code = error_code(raw)
        judged = verdict(status, code)
        if judged is Verdict.KEY:  # the replica refused the gateway's key: ours to fix
            logger.warning("replica %s refused the gateway's key (HTTP %d)", endpoint.url, status)
            outcome.failed(f"HTTP {status}: the gateway's key was refused")
            error = UpstreamError(
                f"{endpoint.name} could not be used (it refused the gateway's credentials); "
                f"the operator should check --replica-api-key (request id {ctx.request_id})."
            )
            return Retry(JSONResponse(error_body(error), status_code=error.status_code))
        if judged is Verdict.FINAL:
            return Response(raw, status, headers, media_type="application/json")
        if status >= 500 and code not in _KNOWN_CODES:
            logger.warning("replica %s answered HTTP %d: %.200r", endpoint.url, status, raw)
            error = UpstreamError(
                f"{endpoint.name} could not answer (HTTP {status}); retry the request "
                f"(request id {ctx.request_id})."
            )
            raw = json.dumps(error_body(error)).encode()
            status = error.status_code
        if judged is Verdict.BROKEN:
            outcome.failed(f"HTTP {status}")
        return Retry(Response(raw, status, headers, media_type="application/json"))

    def _whole(
        self, outcome: Outcome, data: dict[str, Any], headers: dict[str, str]
    ) -> JSONResponse:
        """A whole (non-streamed) answer: recorded, each choice through the output
        filter, with the stitched timings."""
        outcome.whole(data)
        if self.guard is not None:
            judge = ChoiceFilter(self.guard)
            for choice in data.get("choices") or []:  # n answers: each judged on its own
                judge.whole_choice(choice)
        reasons = [c.get("finish_reason") for c in data.get("choices") or []]
        data["timings"] = outcome.ended([r for r in reasons if isinstance(r, str)])
        headers["Server-Timing"] = server_timing(data["timings"])
        response = JSONResponse(data, headers=headers)
        outcome.recorded(whole=True)
        return response

    @staticmethod
    def _timed_out(outcome: Outcome, why: str) -> Response:
        assert outcome.endpoint is not None
        error = UpstreamTimeoutError(
            f"{outcome.endpoint.name} produced {why}; the fleet may be overloaded. Retry the "
            f"request (request id {outcome.ctx.request_id})."
        )
        return JSONResponse(error_body(error), status_code=error.status_code)


def route_request(request: ChatBody | CompletionBody, salt: str | None) -> RouteRequest:
    """The routing view of a checked OpenAI request (``api.prompt.route_text``)."""
    return RouteRequest(route_text(request), salt, chat=isinstance(request, ChatBody))
