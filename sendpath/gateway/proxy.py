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
stopped that request alone). After the first token, ``relay.StreamRelay`` takes over.

If the client leaves while its request is at a replica (a stream before its first token,
or a whole answer at any time: a replica sends a whole answer's headers only when it is
done), the upstream connection is closed at once, which aborts the request there.
Clients never see a replica's address: answers name it (``x-sendpath-replica``) by its
name, and an upstream 5xx whose body is not one of our known errors is replaced by ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sendpath.api.errors import error_body
from sendpath.api.schema import DEFAULT_CAP_HEADER
from sendpath.errors import SendpathError, ServiceUnavailableError
from sendpath.gateway.chunks import SSELines, answer_text, numbers, read_head
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.relay import StreamRelay
from sendpath.gateway.safety import OutputGuard
from sendpath.router.policy import RouteRequest, route_request
from sendpath.router.pool import Endpoint
from sendpath.router.router import Router
from sendpath.server.responses import server_timing

__all__ = ["Proxy", "ProxyTimeouts", "UpstreamTimeoutError"]

logger = logging.getLogger("sendpath.gateway")

T = TypeVar("T")

# Response headers worth passing on from a replica.
_PASS_HEADERS = ("retry-after", "x-request-id")
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


@dataclass(frozen=True)
class ProxyTimeouts:
    """How long the gateway waits on a replica (seconds)."""

    connect_s: float = 5.0
    first_token_s: float = 120.0  # a stream's first token (queue + prefill at the replica)
    between_tokens_s: float = 60.0
    whole_answer_s: float = 600.0  # a non-streamed answer, in full
    retry_deadline_s: float = 30.0  # retries (before the first token) stop after this


@dataclass
class _Retry:
    """An attempt that did not answer: try another replica, else hand back ``response``
    (``late``: the replica timed out or got stuck, so try another even past the window)."""

    response: Response | None = None
    late: bool = False


class _Gone(Exception):
    """The client disconnected while its request was at a replica."""


class _Stuck(Exception):
    """The replica's health check says its engine is stuck: nothing will come back."""


STUCK_POLL_S = 0.5  # how often an attempt waiting at a replica looks at its health
# An idle pooled connection is dropped after this: before the replica's own keep-alive
# bound (uvicorn's 5 s) closes it under a request (aiohttp does not resend a POST)
KEEPALIVE_S = 4.0


async def _body_sent(
    session: aiohttp.ClientSession, trace: Any, params: aiohttp.TraceRequestChunkSentParams
) -> None:
    """aiohttp's trace hook: the attempt's request body went out now."""
    attempt = trace.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.sent = attempt.ctx.clock.now()


class Proxy:
    """Sends requests to replicas over one pooled HTTP client (module docstring).

    The client is aiohttp's (its C parser and pool cost a fraction of httpx's per request:
    ``benchmarks/gateway_overhead.py``), made on first use inside the running loop."""

    def __init__(
        self,
        router: Router,
        guard: Callable[[], OutputGuard] | None,
        timeouts: ProxyTimeouts,
        on_done: Callable[[GatewayContext], None] = lambda ctx: None,
    ) -> None:
        self.router = router
        self.on_done = on_done  # a request finished: record its trace and metrics
        self.guard = guard
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The pooled client (each replica's key goes per request)."""
        if self._session is None:
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_body_sent)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(sock_connect=self.timeouts.connect_s),
                trace_configs=[trace],
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(self, request: Request) -> Response:
        """Forward one POST to ``/v1/chat/completions`` or ``/v1/completions``."""
        ctx = context(request.scope)
        assert ctx.body is not None and ctx.request is not None
        body = ctx.request.model_dump(exclude_unset=True)
        headers: dict[str, str] = {}
        if ctx.cache_salt is not None:
            body["cache_salt"] = ctx.cache_salt
        if ctx.default_max_tokens is not None:
            body["max_tokens"] = ctx.default_max_tokens
            headers[DEFAULT_CAP_HEADER] = "default"
        streaming = body.get("stream") is True
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        wants_usage = options.get("include_usage") is True
        if streaming:
            body["stream_options"] = {**options, "include_usage": True}
        route = route_request(ctx.body, ctx.cache_salt)
        deadline = ctx.clock.now() + self.timeouts.retry_deadline_s
        tried: set[int] = set()
        fallback: Response | None = None
        late = False
        while not tried or late or ctx.clock.now() < deadline:
            endpoint = self.router.choose(route, tried)
            if endpoint is None:
                break
            tried.add(endpoint.index)
            ctx.replica, ctx.replica_name = endpoint.url, endpoint.name
            attempt = _Attempt(self, ctx, request, endpoint, body, headers, wants_usage, route)
            answer = await attempt.run()
            if not isinstance(answer, _Retry):
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
    ) -> Response | _Retry:
        """A replica's error answer: the client's fault is final; busy or broken, retry."""
        try:
            code = json.loads(raw)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if status in (401, 403):  # the replica refused the gateway's key: ours to fix
            logger.warning("replica %s refused the gateway's key (HTTP %d)", endpoint.url, status)
            self.router.failed(endpoint, f"HTTP {status}: the gateway's key was refused")
            error = UpstreamError(
                f"{endpoint.name} could not be used (it refused the gateway's credentials); "
                f"the operator should check --replica-api-key (request id {ctx.request_id})."
            )
            return _Retry(JSONResponse(error_body(error), status_code=error.status_code))
        if status < 500 and status != 429:
            return Response(raw, status, headers, media_type="application/json")
        if code == "request_failed":  # the request's own failure: the replica is fine
            return Response(raw, status, headers, media_type="application/json")
        if status >= 500 and code not in _KNOWN_CODES:
            logger.warning("replica %s answered HTTP %d: %.200r", endpoint.url, status, raw)
            error = UpstreamError(
                f"{endpoint.name} could not answer (HTTP {status}); retry the request "
                f"(request id {ctx.request_id})."
            )
            raw = json.dumps(error_body(error)).encode()
            status = error.status_code
        if status >= 500 and code != "queue_full":
            self.router.failed(endpoint, f"HTTP {status}")
        return _Retry(Response(raw, status, headers, media_type="application/json"))

    def answer(
        self, ctx: GatewayContext, data: dict[str, Any], headers: dict[str, str]
    ) -> JSONResponse:
        """A whole (non-streamed) answer: usage, the output check, merged timings."""
        u = data.get("usage") or {}
        ctx.usage = (int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)))
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if self.guard is not None and isinstance(text, str):
            guard = self.guard()
            released = guard.push(text) + guard.flush()
            if guard.blocked is not None:
                if isinstance(message, dict):
                    message["content"] = released
                else:
                    choice["text"] = released
                choice["finish_reason"] = "content_filter"
        ctx.response_id = data.get("id")
        ctx.replica_timings = numbers(data.get("timings"))
        ctx.end = ctx.clock.now()
        data["timings"] = ctx.timings_ms()
        headers["Server-Timing"] = server_timing(data["timings"])
        self.on_done(ctx)
        return JSONResponse(data, headers=headers)


@dataclass
class _Attempt:
    """One try of one request on one replica."""

    proxy: Proxy
    ctx: GatewayContext
    request: Request
    endpoint: Endpoint
    body: dict[str, Any]
    headers: dict[str, str]
    wants_usage: bool
    route: RouteRequest

    def __post_init__(self) -> None:
        self.held = False
        self.upstream: aiohttp.ClientResponse | None = None
        self.streaming = self.body.get("stream") is True
        self.sent = 0.0  # when the request body went out (``_body_sent``)
        self.passed: dict[str, str] = {}  # the replica's headers the client gets
        self.lines: SSELines | None = None

    def release(self) -> None:
        """Give the endpoint's in-flight slot back (once)."""
        if self.held:
            self.held = False
            self.endpoint.in_flight -= 1

    async def run(self) -> Response | _Retry:
        """Send the request and read up to its first token (or its whole answer)."""
        proxy, ctx, endpoint = self.proxy, self.ctx, self.endpoint
        endpoint.in_flight += 1
        self.held = True
        keep_open = False  # only a stream that started stays open, for the relay
        limit = proxy.timeouts.first_token_s if self.streaming else None
        try:
            async with asyncio.timeout(limit):
                outcome = await _unless_gone(self._exchange(), self.request, endpoint)
            if isinstance(outcome, list):  # a stream's head: its first token is there
                keep_open = True
                return self._relay(outcome)
            return outcome
        except _Gone:  # closing the upstream connection aborts the request there
            return Response(status_code=499)
        except aiohttp.ServerTimeoutError as exc:  # connect (a TimeoutError too): next one
            proxy.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Retry()
        except (TimeoutError, _Stuck) as exc:
            if isinstance(exc, _Stuck):
                why = "a stuck engine"
            elif self.streaming:
                why = f"no first token within {proxy.timeouts.first_token_s:g} s"
            else:
                why = f"no answer within {proxy.timeouts.whole_answer_s:g} s"
            proxy.router.failed(endpoint, why)
            return _Retry(_timeout_response(ctx, endpoint, why), late=True)
        except (aiohttp.ClientError, StopAsyncIteration, ValueError) as exc:
            proxy.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Retry()
        finally:
            if not keep_open:
                if self.upstream is not None:
                    self.upstream.release()  # to the pool if read whole, else closed
                self.release()

    async def _exchange(self) -> Response | _Retry | list[str]:
        """The upstream call: a final answer, a retry, or a stream's head to relay."""
        proxy, ctx, endpoint = self.proxy, self.ctx, self.endpoint
        # The replica's arrival on this clock: its x-sendpath-clock header when that reading
        # falls inside this attempt (same host, same monotonic clock); otherwise the moment
        # the request body was sent.
        t0 = self.sent = ctx.clock.now()
        url = endpoint.url + self.request.url.path
        headers = {**self.headers, **endpoint.headers, "content-type": "application/json"}
        self.upstream = upstream = await proxy.session().post(
            url,
            data=json.dumps(self.body).encode(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(
                total=None if self.streaming else proxy.timeouts.whole_answer_s,
                sock_connect=proxy.timeouts.connect_s,
            ),
            trace_request_ctx=self,
        )
        ctx.reached_replica = True
        self.passed = {k: v for k, v in upstream.headers.items() if k.lower() in _PASS_HEADERS}
        ctx.replica_arrival = _arrival(upstream.headers, t0, ctx.clock.now(), self.sent)
        ctx.replica_request_id = upstream.headers.get("x-request-id")
        if upstream.status != 200:
            raw = await upstream.read()
            return proxy.refused(ctx, endpoint, upstream.status, raw, self.passed)
        if not self.streaming:
            data = json.loads(await upstream.read())
            ctx.end = ctx.clock.now()
            proxy.router.succeeded(endpoint)
            proxy.router.answered(self.route, endpoint, answer_text(data))
            return proxy.answer(ctx, data, self.passed)
        self.lines = SSELines(upstream.content.iter_any())
        head = await read_head(self.lines)
        if (error := _error_event(head)) is not None:  # a 200 that opens with an error
            status, raw = error
            return proxy.refused(ctx, endpoint, status, raw, self.passed)
        return head

    def _relay(self, head: list[str]) -> StreamingResponse:
        proxy = self.proxy
        assert self.upstream is not None and self.lines is not None
        proxy.router.succeeded(self.endpoint)
        relay = StreamRelay(
            self.ctx, proxy.router, self.endpoint, self.route, self.upstream, self.lines, head,
            proxy.guard() if proxy.guard is not None else None, self.wants_usage,
            proxy.timeouts.between_tokens_s, self.release, proxy.on_done,
        )  # fmt: skip
        return StreamingResponse(
            relay.events(), media_type="text/event-stream", headers=self.passed
        )


def _error_event(head: list[str]) -> tuple[int, bytes] | None:
    """(status, body) when a stream's head ends in an error event instead of a token."""
    last = head[-1][5:].strip() if head else ""
    if not last.startswith("{"):
        return None
    error = json.loads(last).get("error")
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 600:  # vLLM puts the status here
        status = code
    else:
        status = {"request_failed": 500, "queue_full": 503, "service_unavailable": 503}.get(
            str(code), 502
        )
    return status, json.dumps({"error": error}).encode()


def _timeout_response(ctx: GatewayContext, endpoint: Endpoint, why: str) -> Response:
    error = UpstreamTimeoutError(
        f"{endpoint.name} produced {why}; the fleet may be overloaded. Retry the request "
        f"(request id {ctx.request_id})."
    )
    return JSONResponse(error_body(error), status_code=error.status_code)


def _arrival(headers: Mapping[str, str], start: float, now: float, sent: float) -> float:
    """When the replica got the request, on this process's clock."""
    try:
        reported = float(headers.get("x-sendpath-clock", "nan"))
    except ValueError:
        return sent
    return reported if start <= reported <= now else sent


async def _unless_gone(work: Awaitable[T], request: Request, endpoint: Endpoint) -> T:
    """The result of ``work``; raises ``_Gone`` if the client disconnected first, ``_Stuck``
    if the replica's health check found its engine stuck first (then ``work`` is
    cancelled: nothing is left running, whatever ends this wait)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def stuck() -> None:
        while not endpoint.stuck:
            await asyncio.sleep(STUCK_POLL_S)

    task = asyncio.ensure_future(work)
    watches = {asyncio.ensure_future(gone()), asyncio.ensure_future(stuck())}
    try:
        await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this task is cancelled (a timeout)
        for watch in watches:
            watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise _Stuck() if endpoint.stuck else _Gone()
    return task.result()
