"""The trace: one event list per request, and the stage durations derived from it.

Everything that shows time (API timings, CLI waterfall, web page, metrics, simulator) reads
the events recorded here with an injected clock. The engine records its part: arrived,
tokenized, queued, scheduled, prefill chunks, tokens, preempted, finished or aborted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, NamedTuple, TypeVar

__all__ = ["Event", "EventType", "Stage", "Timeline", "TraceStore", "event_log", "server_timing"]

T = TypeVar("T")


class Stage(StrEnum):
    """The stages of a message's path, in order (docs/architecture.md's stage table)."""

    GATEWAY_AUTH = "gateway.auth"
    GATEWAY_RATELIMIT = "gateway.ratelimit"
    GATEWAY_SAFETY = "gateway.safety"
    GATEWAY_QUEUE = "gateway.queue"
    ROUTE = "route"
    TOKENIZE = "tokenize"
    ENGINE_QUEUE = "engine.queue"
    PREFILL = "prefill"
    DECODE = "decode"
    STREAM = "stream"
    NETWORK = "network"  # the client's own measure, beyond the server's total


class EventType(StrEnum):
    """What happened to a request inside the engine."""

    ARRIVED = "arrived"  # reached the engine (before tokenizing)
    TOKENIZED = "tokenized"  # chat template + tokenization done
    QUEUED = "queued"  # joined the waiting queue
    SCHEDULED = "scheduled"  # got a slot (first time, and again after each preemption)
    PREFILL_CHUNK = "prefill_chunk"  # a step computed `num_tokens` prompt tokens
    FIRST_TOKEN = "first_token"
    TOKEN = "token"  # every generated token, the first included
    PREEMPTED = "preempted"  # lost its KV blocks; back to the queue, recomputed later
    FINISHED = "finished"
    ABORTED = "aborted"


class Event(NamedTuple):
    """One thing that happened (a tuple: the engine records one per token)."""

    type: EventType
    time: float
    num_tokens: int = 0


@dataclass
class Timeline:
    """A request's events in time order, and what they add up to (seconds)."""

    events: list[Event] = field(default_factory=list)

    def record(self, type: EventType, time: float, num_tokens: int = 0) -> None:
        self.events.append(Event(type, time, num_tokens))

    def first(self, type: EventType) -> float | None:
        return next((e.time for e in self.events if e.type is type), None)

    def last(self, type: EventType) -> float | None:
        return next((e.time for e in reversed(self.events) if e.type is type), None)

    @property
    def token_times(self) -> list[float]:
        return [e.time for e in self.events if e.type is EventType.TOKEN]

    @property
    def end(self) -> float | None:
        return self.last(EventType.FINISHED) or self.last(EventType.ABORTED)

    @property
    def ttft(self) -> float | None:
        """Arrival to first token."""
        start, first = self.first(EventType.ARRIVED), self.first(EventType.FIRST_TOKEN)
        return None if start is None or first is None else first - start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens (inter-token latencies)."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    def stages(self) -> dict[Stage, float]:
        """The engine's stage durations: tokenize, engine.queue, prefill, decode.

        engine.queue is the time spent queued, before the first token and after it (a
        preemption queues a request again); one pass over the events (the simulator asks
        this of a million requests)."""
        firsts: dict[EventType, float] = {}
        finished = aborted = last_token = None
        before = after = 0.0
        since: float | None = None
        seen_token = False
        token, requeued = EventType.TOKEN, (EventType.QUEUED, EventType.PREEMPTED)
        on_slot, first_token = EventType.SCHEDULED, EventType.FIRST_TOKEN
        for kind, at, _ in self.events:  # unpacked: quicker than attribute reads
            if kind is token:  # most events
                last_token = at
                continue
            if kind not in firsts:
                firsts[kind] = at
            if kind in requeued:
                since = at
            elif kind is on_slot and since is not None:
                if seen_token:
                    after += at - since
                else:
                    before += at - since
                since = None
            elif kind is first_token:
                seen_token = True
            elif kind is EventType.FINISHED:
                finished = at
            elif kind is EventType.ABORTED:
                aborted = at
        end = finished or aborted
        out: dict[Stage, float] = {}
        # tokenize runs to the queue (building the request included), so the four stages
        # tile arrival to finish exactly
        arrived = firsts.get(EventType.ARRIVED)
        queued = firsts.get(EventType.QUEUED)
        queued_or_tokenized = queued or firsts.get(EventType.TOKENIZED)
        if arrived is not None and queued_or_tokenized is not None:
            out[Stage.TOKENIZE] = queued_or_tokenized - arrived
        out[Stage.ENGINE_QUEUE] = before + after
        scheduled, first = firsts.get(EventType.SCHEDULED), firsts.get(EventType.FIRST_TOKEN)
        if scheduled is not None and queued is not None:
            end_of_prefill = first if first is not None else (end or scheduled)
            out[Stage.PREFILL] = max(0.0, end_of_prefill - queued - before)
        if first is not None:
            if end:
                last = end
            elif last_token is not None:
                last = last_token
            else:
                raise IndexError("a first token but no token event")
            out[Stage.DECODE] = max(0.0, last - first - after)
        return out


def event_log(timeline: Timeline) -> list[dict[str, Any]]:
    """The events as JSON: type, milliseconds since the first event, tokens involved."""
    if not timeline.events:
        return []
    t0 = timeline.events[0].time
    return [
        {"type": e.type.value, "t_ms": round((e.time - t0) * 1000, 3), "num_tokens": e.num_tokens}
        for e in timeline.events
    ]


class TraceStore(Generic[T]):
    """The most recent traces by request id; past ``capacity`` the oldest are dropped."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, T] = OrderedDict()

    def put(self, request_id: str, trace: T) -> None:
        self._items[request_id] = trace
        self._items.move_to_end(request_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, request_id: str) -> T | None:
        return self._items.get(request_id)

    def pop(self, request_id: str) -> T | None:
        return self._items.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._items)


def server_timing(timings: dict[str, float]) -> str:
    """The W3C Server-Timing header value for a timings object (stage -> ms): what both
    servers send beside their answers."""
    return ", ".join(f"{name};dur={ms}" for name, ms in timings.items())
