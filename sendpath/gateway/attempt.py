"""One try of one request on one replica, up to its first token (or its whole answer).

``Attempt.run`` sends the body over the proxy's pooled client and reads until the first
token exists; its outcome is the client's response, a stream's head for the relay, or a
``Retry`` (try another replica; ``proxy.py`` decides). It watches the client (a
disconnect closes the upstream connection, which aborts the request there) and the
replica's health (a stuck engine is given up on at once), within the first-token timeout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sendpath.api.disconnect import ClientGone, ClientWatch, Interrupt
from sendpath.api.errors import error_body
from sendpath.api.sse import EventStreamResponse
from sendpath.errors import SendpathError
from sendpath.gateway.chunks import Event, SSELines, answer_text, read_head_events
from sendpath.gateway.context import GatewayContext
from sendpath.gateway.relay import StreamRelay
from sendpath.gateway.upstream import ConnectTimeout, UpstreamConnectionError, UpstreamResponse
from sendpath.gateway.verdict import event_status
from sendpath.router.pool import Endpoint
from sendpath.router.route import RouteRequest

if TYPE_CHECKING:
    from sendpath.gateway.proxy import Proxy

__all__ = ["Attempt", "Retry", "UpstreamTimeoutError"]

PASS_HEADERS = ("retry-after", "x-request-id")  # a replica's headers the client gets


class UpstreamTimeoutError(SendpathError):
    """No replica produced a first token in time (HTTP 504)."""

    type = "timeout"
    code = "upstream_timeout"
    status_code = 504


@dataclass
class Retry:
    """An attempt that did not answer: try another replica, else hand back ``response``
    (``late``: the replica timed out or got stuck, so try another even past the window)."""

    response: Response | None = None
    late: bool = False


class _Stuck(Exception):
    """The replica's health check says its engine is stuck: nothing will come back."""


STUCK_POLL_S = 0.5  # how often an attempt waiting at a replica looks at its health


class _StuckWatch:
    """Looks at an endpoint's health now and every ``STUCK_POLL_S`` until cancelled;
    stuck, it stops the attempt (``_Stuck``)."""

    def __init__(self, endpoint: Endpoint, stop: Interrupt) -> None:
        self.endpoint, self.stop = endpoint, stop
        self.poll: asyncio.TimerHandle | None = None
        self._look()

    def _look(self) -> None:
        if self.endpoint.stuck:
            self.stop.fire(_Stuck())
        else:
            self.poll = asyncio.get_running_loop().call_later(STUCK_POLL_S, self._look)

    def cancel(self) -> None:
        if self.poll is not None:
            self.poll.cancel()
            self.poll = None  # it and this refer to each other: let go now


@dataclass
class Attempt:
    """One try of one request on one replica."""

    proxy: Proxy
    ctx: GatewayContext
    request: Request
    endpoint: Endpoint
    body: dict[str, Any]
    headers: dict[str, str]
    wants_usage: bool
    route: RouteRequest
    watch: ClientWatch  # the client: gone, the attempt ends (499)

    def __post_init__(self) -> None:
        self.held = False
        self.upstream: UpstreamResponse | None = None
        self.streaming = self.body.get("stream") is True
        self.passed: dict[str, str] = {}  # the replica's headers the client gets
        self.lines: SSELines | None = None

    def release(self) -> None:
        """Give the endpoint's in-flight slot back (once)."""
        if self.held:
            self.held = False
            self.endpoint.in_flight -= 1

    async def run(self) -> Response | Retry:
        """Send the request and read up to its first token (or its whole answer)."""
        proxy, ctx, endpoint = self.proxy, self.ctx, self.endpoint
        endpoint.in_flight += 1
        self.held = True
        keep_open = False  # only a stream that started stays open, for the relay
        timeouts = proxy.timeouts
        limit = timeouts.first_token_s if self.streaming else timeouts.whole_answer_s
        try:
            async with asyncio.timeout(limit), Interrupt() as stop:
                outcome = await self._watched(stop)
            if isinstance(outcome, list):  # a stream's head: its first token is there
                keep_open = True
                return self._relay(outcome)
            return outcome
        except ClientGone:  # closing the upstream connection aborts the request there
            return Response(status_code=499)
        except ConnectTimeout as exc:  # a TimeoutError too, but the next one is tried as usual
            proxy.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return Retry()
        except (TimeoutError, _Stuck) as exc:
            if isinstance(exc, _Stuck):
                why = "a stuck engine"
            elif self.streaming:
                why = f"no first token within {proxy.timeouts.first_token_s:g} s"
            else:
                why = f"no answer within {proxy.timeouts.whole_answer_s:g} s"
            proxy.router.failed(endpoint, why)
            return Retry(_timeout_response(ctx, endpoint, why), late=True)
        except (UpstreamConnectionError, StopAsyncIteration, ValueError) as exc:
            proxy.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return Retry()
        finally:
            if not keep_open:
                if self.upstream is not None:
                    self.upstream.release()  # to the pool if read whole, else closed
                self.release()

    async def _watched(self, stop: Interrupt) -> Response | Retry | list[Event]:
        """``_exchange``, stopped by ``ClientGone`` if the client disconnects first, by
        ``_Stuck`` if the replica's health check finds its engine stuck first."""
        stuck = _StuckWatch(self.endpoint, stop)
        unwatch = self.watch.on_gone(lambda: stop.fire(ClientGone()))
        try:
            return await self._exchange()
        finally:
            unwatch()
            stuck.cancel()

    async def _exchange(self) -> Response | Retry | list[Event]:
        """The upstream call: a final answer, a retry, or a stream's head to relay."""
        proxy, ctx, endpoint = self.proxy, self.ctx, self.endpoint
        # The replica's arrival on this clock: its x-sendpath-clock header when that reading
        # falls inside this attempt (same host, same monotonic clock); otherwise the moment
        # the request was written.
        t0 = sent = ctx.clock.now()

        def written() -> None:
            nonlocal sent
            sent = ctx.clock.now()

        url = endpoint.url + self.request.scope["path"]  # one of the two generation paths
        headers = {**self.headers, **endpoint.headers, "content-type": "application/json"}
        body = json.dumps(self.body).encode()
        self.upstream = upstream = await proxy.client.post(url, body, headers, written)
        ctx.reached_replica = True
        self.passed = {k: v for k, v in upstream.headers.items() if k in PASS_HEADERS}
        ctx.replica_arrival = _arrival(upstream.headers, t0, ctx.clock.now(), sent)
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
        head = await read_head_events(self.lines)
        if (error := _error_event(head)) is not None:  # a 200 that opens with an error
            status, raw = error
            return proxy.refused(ctx, endpoint, status, raw, self.passed)
        return head

    def _relay(self, head: list[Event]) -> EventStreamResponse:
        proxy = self.proxy
        assert self.upstream is not None and self.lines is not None
        proxy.router.succeeded(self.endpoint)
        relay = StreamRelay(
            self.ctx, proxy.router, self.endpoint, self.route, self.upstream, self.lines, head,
            proxy.guard, self.wants_usage,
            proxy.timeouts.between_tokens_s, self.release, proxy.on_done,
        )  # fmt: skip
        return EventStreamResponse(relay.events(), self.watch, self.passed)


def _error_event(head: list[Event]) -> tuple[int, bytes] | None:
    """(status, body) when a stream's head ends in an error event instead of a token."""
    last = head[-1][1] if head else None
    if last is None:
        return None
    error = last.get("error")
    if not isinstance(error, dict):
        return None
    return event_status(error), json.dumps({"error": error}).encode()


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
