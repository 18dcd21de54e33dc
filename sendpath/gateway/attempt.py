"""One try of one request on one replica, up to its first token (or its whole answer).

``Attempt.run`` sends the body over the pooled client and reads until the first token
exists. It returns plain data, and decides nothing about the request: the replica's
whole answer (``Whole``), a stream's head for the relay (``Head``), its error answer
(``Refused``: the proxy's ``verdict`` says final or retry), no answer at all
(``Failed``: try another replica) or the client's leaving (``Gone``). It watches the
client (a disconnect closes the upstream connection, which aborts the request there) and
the replica's health (a stuck engine is given up on at once), within ``limit_s``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sendpath.api.disconnect import ClientGone, ClientWatch, Interrupt
from sendpath.gateway.chunks import Event, SSELines, read_head_events
from sendpath.gateway.outcome import Outcome
from sendpath.gateway.upstream import (
    ConnectTimeout,
    UpstreamClient,
    UpstreamConnectionError,
    UpstreamResponse,
)
from sendpath.gateway.verdict import event_status
from sendpath.router.pool import Endpoint

__all__ = ["Attempt", "Exchange", "Failed", "Gone", "Head", "Refused", "Whole"]

PASS_HEADERS = ("retry-after", "x-request-id")  # a replica's headers the client gets


@dataclass
class Whole:
    """The replica's whole answer (HTTP 200), parsed."""

    data: dict[str, Any]
    headers: dict[str, str]  # the replica's headers the client gets


@dataclass
class Head:
    """A stream whose first token is here: the relay reads on from ``lines``."""

    events: list[Event]  # up to the first token (``chunks.read_head_events``)
    upstream: UpstreamResponse
    lines: SSELines
    headers: dict[str, str]
    release: Callable[[], None]  # gives the endpoint's in-flight slot back (once)


@dataclass
class Refused:
    """The replica's error answer: its status and body (a stream that opened with an
    error event: that error, with its status)."""

    status: int
    raw: bytes
    headers: dict[str, str]


@dataclass
class Failed:
    """No answer (it counts against the replica): ``why``, in words that name no address;
    ``late``: it timed out or got stuck, so another is tried even past the retry window."""

    why: str
    late: bool = False


@dataclass
class Gone:
    """The client disconnected while the request was at the replica (aborted there)."""


Exchange = Whole | Head | Refused | Failed | Gone


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

    client: UpstreamClient
    outcome: Outcome  # what the attempt learns of the replica goes there
    endpoint: Endpoint
    path: str  # one of the two generation paths
    body: bytes  # the JSON body the replica gets
    headers: dict[str, str]
    streaming: bool
    limit_s: float  # a stream's first token, or a whole answer, within this
    watch: ClientWatch  # the client: gone, the attempt ends

    def __post_init__(self) -> None:
        self.held = False
        self.upstream: UpstreamResponse | None = None

    def release(self) -> None:
        """Give the endpoint's in-flight slot back (once)."""
        if self.held:
            self.held = False
            self.endpoint.in_flight -= 1

    async def run(self) -> Exchange:
        """Send the request and read up to its first token (or its whole answer)."""
        self.endpoint.in_flight += 1
        self.held = True
        keep_open = False  # only a stream that started stays open, for the relay
        try:
            async with asyncio.timeout(self.limit_s), Interrupt() as stop:
                outcome = await self._watched(stop)
            keep_open = isinstance(outcome, Head)
            return outcome
        except ClientGone:  # closing the upstream connection aborts the request there
            return Gone()
        except ConnectTimeout as exc:  # a TimeoutError too, but the next one is tried as usual
            return Failed(f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            what = "first token" if self.streaming else "answer"
            return Failed(f"no {what} within {self.limit_s:g} s", late=True)
        except _Stuck:
            return Failed("a stuck engine", late=True)
        except (UpstreamConnectionError, StopAsyncIteration, ValueError) as exc:
            return Failed(f"{type(exc).__name__}: {exc}")
        finally:
            if not keep_open:
                if self.upstream is not None:
                    self.upstream.release()  # to the pool if read whole, else closed
                self.release()

    async def _watched(self, stop: Interrupt) -> Exchange:
        """``_exchange``, stopped by ``ClientGone`` if the client disconnects first, by
        ``_Stuck`` if the replica's health check finds its engine stuck first."""
        stuck = _StuckWatch(self.endpoint, stop)
        unwatch = self.watch.on_gone(lambda: stop.fire(ClientGone()))
        try:
            return await self._exchange()
        finally:
            unwatch()
            stuck.cancel()

    async def _exchange(self) -> Exchange:
        """The upstream call, read up to its first token or its end."""
        clock = self.outcome.ctx.clock
        # The replica's arrival on this clock: its x-sendpath-clock header when that reading
        # falls inside this attempt (same host, same monotonic clock); otherwise the moment
        # the request was written.
        t0 = sent = clock.now()

        def written() -> None:
            nonlocal sent
            sent = clock.now()

        endpoint = self.endpoint
        headers = {**self.headers, **endpoint.headers, "content-type": "application/json"}
        url = endpoint.url + self.path
        self.upstream = upstream = await self.client.post(url, self.body, headers, written)
        self.outcome.reached(
            upstream.status, upstream.headers, _arrival(upstream.headers, t0, clock.now(), sent)
        )
        passed = {k: v for k, v in upstream.headers.items() if k in PASS_HEADERS}
        if upstream.status != 200:
            return Refused(upstream.status, await upstream.read(), passed)
        if not self.streaming:
            return Whole(json.loads(await upstream.read()), passed)
        lines = SSELines(upstream.content.iter_any())
        head = await read_head_events(lines)
        if (error := _error_event(head)) is not None:  # a 200 that opens with an error
            return Refused(*error, passed)
        return Head(head, upstream, lines, passed, self.release)


def _error_event(head: list[Event]) -> tuple[int, bytes] | None:
    """(status, body) when a stream's head ends in an error event instead of a token."""
    last = head[-1][1] if head else None
    if last is None:
        return None
    error = last.get("error")
    if not isinstance(error, dict):
        return None
    return event_status(error), json.dumps({"error": error}).encode()


def _arrival(headers: Mapping[str, str], start: float, now: float, sent: float) -> float:
    """When the replica got the request, on this process's clock."""
    try:
        reported = float(headers.get("x-sendpath-clock", "nan"))
    except ValueError:
        return sent
    return reported if start <= reported <= now else sent
