"""One request's state as it passes through the gateway, and small ASGI helpers.

The outermost middleware puts a ``GatewayContext`` in the ASGI scope. Each field has one
writer: the request side, each middleware its own part (the key, the parsed body, the
reservation, its stage's mark); the answer side (from ``attempts`` on), only
``outcome.Outcome``, where the forward path records what the replica sent, so the rate
limiter can settle with real numbers and the trace can be drawn.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from sendpath.api.prompt import GenerationBody
from sendpath.api.schema import ChatBody
from sendpath.clock import Clock
from sendpath.gateway.keys import ApiKey
from sendpath.telemetry.trace_context import TraceParent
from sendpath.trace import Stage

__all__ = [
    "AttemptRecord",
    "GatewayContext",
    "GenerationBody",
    "context",
    "max_tokens_asked",
]

SCOPE_KEY = "sendpath.gateway"
# The gateway's own stages before the replica, in path order.
GATEWAY_STAGES = (
    Stage.GATEWAY_AUTH,
    Stage.GATEWAY_RATELIMIT,
    Stage.GATEWAY_SAFETY,
    Stage.GATEWAY_QUEUE,
)
# The replica's stages in the order they happen there (it tokenizes before queueing).
REPLICA_STAGES = (Stage.TOKENIZE, Stage.ENGINE_QUEUE, Stage.PREFILL, Stage.DECODE)


@dataclass
class AttemptRecord:
    """One try on one replica, as the trace shows it."""

    replica: str  # its name
    url: str  # internal: operators see it, clients never do
    start: float
    span_id: int  # the traceparent it was sent (0: tracing off)
    end: float | None = None
    status: int | None = None  # the replica's HTTP status
    error: str | None = None  # why it counted against the replica


@dataclass
class GatewayContext:
    """What the gateway knows about one request so far (times on ``clock``).

    The stitched timeline: each gateway stage ends at its mark (so reading the body counts
    in ``gateway.ratelimit``, the first stage that needs it); ``route`` runs from admission
    to the replica's arrival; the replica's own stages follow; ``stream`` is from the
    replica's finish to the last event written here. The stages add up to ``total``.
    """

    clock: Clock
    start: float
    request_id: str = ""  # the gateway's id for it (x-request-id; errors name it)
    status: int | None = None  # the status code sent to the client, once sent
    marks: dict[Stage, float] = field(default_factory=dict)  # when each stage ended
    key: ApiKey | None = None  # None: keys are not required and none was sent
    cache_salt: str | None = None  # set under per-key prefix-cache isolation
    body: dict[str, Any] | None = None  # the JSON body as sent on (generation POSTs only)
    request: GenerationBody | None = None  # the same body, checked against its schema
    prompt_tokens: int = 0  # the estimate reserved at admission
    default_max_tokens: int | None = None  # the cap sent upstream for a request without one
    client_id: str | None = None  # the client's own name for it (x-sendpath-client-id)
    trace: TraceParent | None = None  # its span in the caller's trace (None: tracing off)
    parent_span_id: int | None = None  # the caller's span, from its traceparent
    # The answer side, written by ``outcome.Outcome`` alone.
    attempts: list[AttemptRecord] = field(default_factory=list)  # each try, in order
    # why it went there: the route's prediction and where the replica runs (operator view)
    routing: dict[str, Any] | None = None
    replica_request_id: str | None = None  # the replica's id for it (its x-request-id)
    replica_arrival: float | None = None  # on this clock (exact on one host, else estimated)
    usage: tuple[int, int] | None = None  # (prompt, completion) as the replica reported it
    cached_tokens: int | None = None  # of the prompt, from its cache, as the replica reported
    streamed_chunks: int = 0  # text chunks relayed (the usage estimate if none is reported)
    first_token_at: float | None = None
    first_token_held: int | None = None  # text chunks the output filter held the first for
    relayed: list[float] = field(default_factory=list)  # when each text chunk went out
    response_id: str | None = None
    finish_reasons: list[str] = field(default_factory=list)  # each choice's, as sent on
    error_type: str | None = None  # why an answer that had started did not end well
    replica_timings: dict[str, float] = field(default_factory=dict)  # the replica's, in ms
    end: float | None = None  # the last event written
    # (stages, timings) as ``finish`` computed them: the answer's, the trace's, the metrics'
    final: tuple[list[tuple[Stage, float, float]], dict[str, float]] | None = None

    @property
    def replica(self) -> str | None:
        """The URL it went to last (internal: never shown to clients)."""
        return self.attempts[-1].url if self.attempts else None

    @property
    def replica_name(self) -> str | None:
        """The name clients see of the replica it went to last ("replica-0")."""
        return self.attempts[-1].replica if self.attempts else None

    @property
    def reached_replica(self) -> bool:
        """A replica answered it (any status): it cost something."""
        return any(a.status is not None for a in self.attempts)

    def span(self, stage: Stage) -> Span:
        """Run a gateway stage; it ends (its mark) when the block does."""
        return Span(self, stage)

    def used_tokens(self) -> int:
        """Tokens this request consumed: as reported, else estimated from what was relayed."""
        if self.usage is not None:
            return sum(self.usage)
        return self.prompt_tokens + self.streamed_chunks if self.streamed_chunks else 0

    def finish(self) -> dict[str, float]:
        """The answer ends now: sets ``end``, and computes the stages and the response's
        ``timings`` once (kept in ``final`` for the trace and the metrics)."""
        self.end = self.clock.now()
        stages = self.stage_seconds()
        self.final = (stages, self.timings_ms(stages))
        return self.final[1]

    def stage_seconds(self) -> list[tuple[Stage, float, float]]:
        """(stage, start, duration) in seconds from ``start``, in path order."""
        out: list[tuple[Stage, float, float]] = []
        prev = self.start
        for stage in GATEWAY_STAGES:
            if stage in self.marks:
                out.append((stage, prev - self.start, self.marks[stage] - prev))
                prev = self.marks[stage]
        if self.replica_arrival is None:
            return out
        arrival = max(prev, self.replica_arrival)
        out.append((Stage.ROUTE, prev - self.start, arrival - prev))
        t = arrival
        for stage in REPLICA_STAGES:
            if stage.value in self.replica_timings:
                duration = self.replica_timings[stage.value] / 1000
                out.append((stage, t - self.start, duration))
                t += duration
        end = self.end if self.end is not None else self.clock.now()
        out.append((Stage.STREAM, t - self.start, max(0.0, end - t)))
        return out

    def timings_ms(
        self, stages: list[tuple[Stage, float, float]] | None = None
    ) -> dict[str, float]:
        """The response's ``timings``: every stage in path order (``stages``: from
        ``stage_seconds``, if already computed), then ``ttft`` and ``total`` as measured
        here, where the client's request arrived."""

        def ms(seconds: float) -> float:
            return round(seconds * 1000, 3)

        stages = self.stage_seconds() if stages is None else stages
        out = {stage.value: ms(duration) for stage, _, duration in stages}
        if self.first_token_at is not None:
            out["ttft"] = ms(self.first_token_at - self.start)
        elif "ttft" in self.replica_timings:  # a whole answer: the replica's
            out["ttft"] = self.replica_timings["ttft"]
        end = self.end if self.end is not None else self.clock.now()
        out["total"] = ms(end - self.start)
        return out


class Span:
    """A ``with`` block that is one gateway stage: its end, however the block ends, is
    the stage's mark (a plain class: a generator-made context manager costs 2.5x as much,
    four times a request)."""

    __slots__ = ("ctx", "stage")

    def __init__(self, ctx: GatewayContext, stage: Stage) -> None:
        self.ctx, self.stage = ctx, stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self.ctx.marks[self.stage] = self.ctx.clock.now()


def context(scope: MutableMapping[str, Any]) -> GatewayContext:
    """The request's context (the tracing middleware must have run)."""
    ctx: GatewayContext = scope["state"][SCOPE_KEY]
    return ctx


def max_tokens_asked(request: GenerationBody) -> int | None:
    """The answer's cap as the backend honours it: chat takes ``max_completion_tokens``
    over ``max_tokens``; completions read ``max_tokens`` only. ``None``: not given."""
    if isinstance(request, ChatBody) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens
