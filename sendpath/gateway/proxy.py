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
stopped that request alone). One try is ``attempt.Attempt``; after the first token,
``relay.StreamRelay`` takes over.

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
from sendpath.gateway.attempt import Attempt, Retry, UpstreamTimeoutError
from sendpath.gateway.chunks import numbers
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.safety import OutputGuard
from sendpath.gateway.upstream import UpstreamClient
from sendpath.gateway.verdict import Verdict, error_code, verdict
from sendpath.router.pool import Endpoint
from sendpath.router.route import RouteRequest
from sendpath.router.router import Router
from sendpath.trace import server_timing

__all__ = ["Proxy", "ProxyTimeouts", "UpstreamTimeoutError", "route_request"]

logger = logging.getLogger("sendpath.gateway")


# Error codes whose bodies pass through as the replica wrote them (ours: no internals).
_KNOWN_CODES = frozenset(
    {"queue_full", "service_unavailable", "request_failed", "internal_error", "model_not_found"}
)


class UpstreamError(SendpathError):
    """A replica answered with a server error we do not know (HTTP 502)."""

    type = "server_error"
    code = "upstream_error"
    status_code = 502


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
        guard: Callable[[], OutputGuard] | None,
        timeouts: ProxyTimeouts,
        on_done: Callable[[GatewayContext], None] = lambda ctx: None,
    ) -> None:
        self.router = router
        self.on_done = on_done  # a request finished: record its trace and metrics
        # a prompt's token ids from a replica, for precise prefix routing (None: not asked)
        self.tokenize: Callable[[GenerationBody], Awaitable[list[int] | None]] | None = None
        self.guard = guard
        self.timeouts = timeouts
        # the pooled client (each replica's key goes per request)
        self.client = UpstreamClient(timeouts.connect_s, KEEPALIVE_S)

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
        deadline = ctx.clock.now() + self.timeouts.retry_deadline_s
        tried: set[int] = set()
        fallback: Response | None = None
        late = False
        while not tried or late or ctx.clock.now() < deadline:
            chosen = self.router.route(route, tried)
            if chosen is None:
                break
            endpoint, prediction = chosen
            tried.add(endpoint.index)
            ctx.replica, ctx.replica_name = endpoint.url, endpoint.name
            ctx.routing = {
                "policy": self.router.policy.name,
                **(prediction.to_dict() if prediction is not None else {}),
                "runs_on": endpoint.where or None,
            }
            attempt = Attempt(
                self, ctx, request, endpoint, body, headers, wants_usage, route, watch
            )
            answer = await attempt.run()
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

    def refused(
        self,
        ctx: GatewayContext,
        endpoint: Endpoint,
        status: int,
        raw: bytes,
        headers: dict[str, str],
    ) -> Response | Retry:
        """A replica's error answer: final, or a retry elsewhere (``verdict.py``)."""
        code = error_code(raw)
        judged = verdict(status, code)
        if judged is Verdict.KEY:  # the replica refused the gateway's key: ours to fix
            logger.warning("replica %s refused the gateway's key (HTTP %d)", endpoint.url, status)
            self.router.failed(endpoint, f"HTTP {status}: the gateway's key was refused")
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
            self.router.failed(endpoint, f"HTTP {status}")
        return Retry(Response(raw, status, headers, media_type="application/json"))

    @staticmethod
    def _check(choice: dict[str, Any], new_guard: Callable[[], OutputGuard]) -> None:
        """The output filter over one whole choice: its text, and each tool call's
        arguments on their own. Blocked: the text released before the phrase, no calls,
        finish_reason ``content_filter``."""
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        released, blocked = "", False
        if isinstance(text, str):
            guard = new_guard()
            released = guard.push(text) + guard.flush()
            blocked = guard.blocked is not None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str) and not blocked:
                guard = new_guard()
                guard.push(arguments)
                guard.flush()
                blocked = guard.blocked is not None
        if not blocked:
            return
        if isinstance(message, dict):
            message["content"] = released
            message.pop("tool_calls", None)
        else:
            choice["text"] = released
        choice["finish_reason"] = "content_filter"
        choice["logprobs"] = None  # they spell out the blocked text

    def answer(
        self, ctx: GatewayContext, data: dict[str, Any], headers: dict[str, str]
    ) -> JSONResponse:
        """A whole (non-streamed) answer: usage, the output check, merged timings."""
        ctx.reported_usage(data.get("usage") or {})
        for choice in data.get("choices") or []:  # n answers: each checked on its own
            if self.guard is not None:
                self._check(choice, self.guard)
        ctx.response_id = data.get("id")
        ctx.replica_timings = numbers(data.get("timings"))
        data["timings"] = ctx.finish()
        headers["Server-Timing"] = server_timing(data["timings"])
        self.on_done(ctx)
        return JSONResponse(data, headers=headers)


def route_request(request: ChatBody | CompletionBody, salt: str | None) -> RouteRequest:
    """The routing view of a checked OpenAI request (``api.prompt.route_text``)."""
    return RouteRequest(route_text(request), salt, chat=isinstance(request, ChatBody))
