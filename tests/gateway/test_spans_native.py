"""The gateway's spans built and encoded in one C call (gateway/spans_native.c) are the
spans ``gateway_span`` builds and ``otlp.encode_tree`` writes, for any context a request
can leave behind: decoded with opentelemetry-proto and compared span for span (the ids
drawn at random on either side, bare stages' and attempts' without one, set aside)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span

from sendpath.clock import VirtualClock
from sendpath.gateway import spans
from sendpath.gateway.context import AttemptRecord, GatewayContext
from sendpath.gateway.keys import ApiKey
from sendpath.telemetry.export import Tracing
from sendpath.telemetry.otlp import SpanTree, encode_tree_python
from sendpath.telemetry.trace_context import TraceParent
from sendpath.trace import Stage

TRACE, ROOT, CALLER = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 0x77

text = st.text(max_size=40) | st.sampled_from(["", "x\ud800y", "é" * 300, "m" * 257])
anything = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
edges = [None, True, False, 0, 1, 2, -1, 1.0, 0.5, -0.0, 2**63, 2**64, "1", [1]]
numbers = st.sampled_from(edges) | st.integers(-5, 2**64) | st.floats(allow_nan=False) | text
stops = (
    text
    | st.lists(text, max_size=18)
    | st.lists(st.text(min_size=1020, max_size=1030), min_size=1, max_size=2)
    | st.lists(anything, max_size=3)
    | anything
)
body_fields = {
    "model": text | anything,
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "frequency_penalty": numbers,
    "presence_penalty": numbers,
    "seed": numbers,
    "n": numbers,
    "stop": stops,
}
bodies = st.none() | st.fixed_dictionaries({}, optional=body_fields)
statuses = st.none() | st.sampled_from([200, 400, 429, 499, 502, 503])
times = st.floats(0.0, 10.0, allow_nan=False)
attempts = st.builds(
    AttemptRecord,
    replica=st.sampled_from(["replica-0", "replica-1", "r\ud800"]),
    url=st.sampled_from(["http://127.0.0.1:9001", "http://10.0.0.2:8000"]),
    start=times,
    span_id=st.sampled_from([0, 1, 0x1234, 2**64 - 1]),
    end=st.none() | times,
    status=statuses,
    error=st.none() | st.sampled_from(["timeout", "connect_error"]),
)
routings = st.none() | st.fixed_dictionaries(
    {},
    optional={
        "policy": st.sampled_from(["prefix_aware", "round_robin"]),
        "match": text | anything,
        "predicted_cached_tokens": numbers,
        "runs_on": st.none() | text,
    },
)


@st.composite
def contexts(draw: st.DrawFn) -> GatewayContext:
    clock = VirtualClock(draw(st.floats(1.0, 1e6)))
    ctx = GatewayContext(clock, clock.now(), request_id=draw(st.sampled_from(["req-1", "r\ud800"])))
    at = ctx.start
    for stage in (Stage.GATEWAY_AUTH, Stage.GATEWAY_RATELIMIT, Stage.GATEWAY_SAFETY):
        if draw(st.booleans()):
            at += draw(times)
            ctx.marks[stage] = at
    ctx.body = draw(bodies)
    ctx.status = draw(statuses)
    ctx.error_type = draw(st.none() | st.sampled_from(["stream_broken", "output_filter"]))
    if draw(st.booleans()):
        ctx.key = ApiKey(draw(st.sampled_from(["team-a", "é"])), "sk-", None, None, None, 0.0, None)
    ctx.client_id = draw(st.none() | text)
    ctx.response_id = draw(st.none() | st.just("chatcmpl-1"))
    ctx.finish_reasons = draw(st.lists(st.sampled_from(["stop", "length"]), max_size=2))
    ctx.usage = draw(st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
    ctx.cached_tokens = draw(st.none() | st.integers(0, 10**6))
    ctx.first_token_at = draw(st.none() | times.map(lambda t: ctx.start + t))
    ctx.first_token_held = draw(st.none() | st.integers(0, 5))
    ctx.attempts = [
        AttemptRecord(**{**a.__dict__, "start": ctx.start + a.start})
        for a in draw(st.lists(attempts, max_size=3))
    ]
    ctx.routing = draw(routings)
    if draw(st.booleans()) and ctx.attempts:
        ctx.replica_arrival = ctx.start + draw(times)
        ctx.replica_timings = {"tokenize": 0.5, "prefill": draw(times), "decode": 3.0}
    clock.advance(draw(times))
    if draw(st.booleans()):
        ctx.finish()  # else ``final`` is None and the stages are computed now
    return ctx


def decoded(data: bytes) -> list[Span]:
    """The spans, with the ids drawn at random (bare stages', attempts' without one) unset."""
    scope = ScopeSpans()
    scope.MergeFromString(data)
    for span in scope.spans:
        if span.kind == Span.SPAN_KIND_INTERNAL or span.span_id in (bytes(8),):
            span.span_id = b""
    return list(scope.spans)


def both(native: ModuleType, ctx: GatewayContext, caller: int | None) -> tuple[bytes, bytes]:
    end, offset = ctx.clock.now() + 1.0, 1.7e9
    tree = SpanTree(spans.gateway_span(ctx, "chat", end), TRACE, ROOT, caller, 1, offset)
    python = encode_tree_python(tree)
    c = native.encode_gateway(
        ctx,
        "chat",
        end,
        spans._OWN,
        TRACE.to_bytes(16, "big"),
        ROOT.to_bytes(8, "big"),
        None if caller is None else caller.to_bytes(8, "big"),
        offset,
    )
    return python, c


def unset_random_attempt_ids(ctx: GatewayContext, found: list[Span]) -> None:
    for span, attempt in zip(found[1 : 1 + len(ctx.attempts)], ctx.attempts, strict=True):
        if not attempt.span_id:
            span.span_id = b""


@settings(max_examples=400, deadline=None)
@given(ctx=contexts(), caller=st.none() | st.just(CALLER))
def test_the_c_build_writes_what_gateway_span_and_encode_tree_write(
    native_spans: ModuleType, ctx: GatewayContext, caller: int | None
) -> None:
    python, c = both(native_spans, ctx, caller)
    ours, theirs = decoded(python), decoded(c)
    unset_random_attempt_ids(ctx, ours)
    unset_random_attempt_ids(ctx, theirs)
    assert ours == theirs
    assert len(python) == len(c)


def test_the_c_build_refuses_a_context_it_cannot_read(native_spans: ModuleType) -> None:
    clock = VirtualClock(5.0)
    ctx = GatewayContext(clock, 5.0, request_id="r")
    ctx.usage = (1, 2, 3)  # type: ignore[assignment]
    with pytest.raises(TypeError, match="usage"):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(16), bytes(8), None, 0.0)
    ctx.usage, ctx.body = None, ["not", "a", "dict"]  # type: ignore[assignment]
    with pytest.raises(TypeError, match="body"):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(16), bytes(8), None, 0.0)
    ctx.body, ctx.end = None, "x"  # type: ignore[assignment]  # not a time: a TypeError
    with pytest.raises(TypeError):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(16), bytes(8), None, 0.0)
    ctx.end, ctx.routing = None, ["not", "a", "dict"]  # type: ignore[assignment]
    with pytest.raises(TypeError, match="routing"):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(16), bytes(8), None, 0.0)
    ctx.routing, ctx.start = None, float("nan")
    with pytest.raises(OverflowError):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(16), bytes(8), None, 0.0)
    with pytest.raises(ValueError, match="16 bytes"):
        native_spans.encode_gateway(ctx, "chat", 6.0, {}, bytes(15), bytes(8), None, 0.0)


class Queued:
    """A Tracing that takes bytes, keeping what it is given."""

    encoded = True

    def __init__(self) -> None:
        self.items: list[bytes] = []

    def emit_encoded(self, data: bytes) -> None:
        self.items.append(data)

    @staticmethod
    def unix_offset(clock: Any) -> float:
        return 0.0


@pytest.fixture
def in_c(native_spans: ModuleType) -> Iterator[tuple[VirtualClock, Any, spans.SpanExport]]:
    """A clock, a Tracing that keeps what it is given, and a SpanExport building in C."""
    clock = VirtualClock(5.0)
    tracing = Queued()
    assert spans.prefer_native() == "in C (gateway/spans_native.c)"
    try:
        yield clock, tracing, spans.SpanExport(tracing, clock)  # type: ignore[arg-type]
    finally:
        spans.prefer_native(False)


async def until(cond: Callable[[], bool]) -> None:
    """Let the event loop run until ``cond`` holds (its timers fire), 20 s at most."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.01)


def traced_context(i: int, clock: VirtualClock) -> GatewayContext:
    ctx = GatewayContext(clock, clock.now(), request_id=f"r{i}", status=200)
    ctx.trace = TraceParent(TRACE + i, ROOT)
    return ctx


def test_spans_are_built_in_c_a_batch_at_a_time_and_in_python_at_once(
    in_c: tuple[VirtualClock, Any, spans.SpanExport],
) -> None:
    clock, tracing, export = in_c

    async def run() -> None:
        for i in range(3):
            export.ended(traced_context(i, clock), "chat", 6.0)
        assert tracing.items == []  # they wait for more, at most FLUSH_S
        await until(lambda: len(tracing.items) == 3)  # the flush when its time comes
        assert len(tracing.items) == 3
        for i in range(3, 3 + spans.BATCH):
            export.ended(traced_context(i, clock), "chat", 6.0)
        assert len(tracing.items) == 3 + spans.BATCH  # a full batch goes at once
        unsampled = traced_context(99, clock)
        unsampled.trace = TraceParent(TRACE, ROOT, 0)
        export.ended(unsampled, "chat", 6.0)
        export.flush()
        assert len(tracing.items) == 3 + spans.BATCH

    asyncio.run(run())
    c = [decoded(item) for item in tracing.items]
    assert spans.prefer_native(False) == "in Python"
    export.ended(traced_context(0, clock), "chat", 6.0)  # at once: nothing to wait for
    assert decoded(tracing.items[-1]) == c[0]
    trace_ids = [found[0].trace_id for found in c]
    assert trace_ids == [(TRACE + i).to_bytes(16, "big") for i in range(3 + spans.BATCH)]


def test_a_request_whose_spans_cannot_be_built_costs_the_others_nothing(
    in_c: tuple[VirtualClock, Any, spans.SpanExport], caplog: pytest.LogCaptureFixture
) -> None:
    clock, tracing, export = in_c
    bad = traced_context(1, clock)
    bad.usage = (1, 2, 3)  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="sendpath.gateway"):
        export.ended(traced_context(0, clock), "chat", 6.0)  # no event loop: at once
        export.ended(bad, "chat", 6.0)
        export.ended(traced_context(2, clock), "chat", 6.0)
    assert len(tracing.items) == 2 and "request r1: its spans could not be exported" in caplog.text


def test_the_gateway_says_how_it_builds_its_spans(
    native_spans: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    from sendpath.config import GatewayConfig
    from sendpath.gateway.parts import _tracing

    config = GatewayConfig(otlp_traces_endpoint="http://127.0.0.1:1/v1/traces")
    try:
        with caplog.at_level(logging.INFO, logger="sendpath.gateway"):
            tracing = _tracing(config)
        assert isinstance(tracing, Tracing) and tracing.encoded
        assert "gateway spans built in C (gateway/spans_native.c)" in caplog.text
        tracing.shutdown()
    finally:
        spans.prefer_native(False)


def test_held_spans_end_when_their_request_did_and_long_prompts_are_not_held(
    in_c: tuple[VirtualClock, Any, spans.SpanExport],
) -> None:
    clock, tracing, export = in_c
    cut = traced_context(0, clock)  # a stream cut short: never finished, so no ``final``
    cut.attempts = [AttemptRecord("replica-0", "http://r", 5.0, 0x42)]
    cut.replica_arrival = 5.001

    async def run() -> None:
        export.ended(cut, "chat", 5.01)
        clock.advance(1.0)  # the batch is built a second later
        export.flush()
        long = traced_context(1, clock)
        long.prompt_tokens = spans.HOLD_TOKENS + 1  # its body is large: not held
        export.ended(long, "chat", 6.0)
        assert len(tracing.items) == 2
        export.ended(traced_context(2, clock), "chat", 6.0)
        assert len(tracing.items) == 2  # held
        export.close()
        assert len(tracing.items) == 3
        export.ended(traced_context(3, clock), "chat", 6.0)  # after close: at once
        assert len(tracing.items) == 4

    asyncio.run(run())
    stream = next(s for s in decoded(tracing.items[0]) if s.name == "stream")
    assert stream.end_time_unix_nano / 1e9 < 5.02  # not a second later


def test_a_batch_waiting_on_a_stopped_event_loop_is_sent_from_the_next(
    in_c: tuple[VirtualClock, Any, spans.SpanExport],
) -> None:
    clock, tracing, export = in_c

    async def one(i: int) -> None:
        export.ended(traced_context(i, clock), "chat", 6.0)

    async def then_wait() -> None:
        export.ended(traced_context(1, clock), "chat", 6.0)
        await until(lambda: len(tracing.items) == 2)

    asyncio.run(one(0))  # its loop stops before the flush is due
    asyncio.run(then_wait())
    assert len(tracing.items) == 2
