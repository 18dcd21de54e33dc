"""A finished request's spans on the gateway, from its context (``docs/observability.md``).

One server span per generation request, ``{operation} {model}`` (the GenAI conventions'
name), whose children are the gateway's stages as the trace counts them
(``gateway.auth``, ``gateway.ratelimit``, ``gateway.safety``, ``gateway.queue``,
``route``, ``stream``) and one client span per upstream attempt, siblings in the order
they were tried. Each attempt's span id is the ``traceparent`` its replica was sent, so
the replica's own span (``server/spans.py``) hangs under the attempt that reached it.

Where spans go out as OTLP bytes, ``encoded_spans`` builds and encodes them in one C
call (``spans_native.c``, built at start where a C compiler is found: ``prefer_native``),
the same bytes as ``gateway_span`` and ``otlp.encode_tree`` make; in a loaded gateway
the Python steps of building the tree cost two to three times what they cost alone.
``SpanExport`` makes them a few requests at a time.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import ModuleType

from sendpath.clock import Clock
from sendpath.gateway.context import AttemptRecord, GatewayContext
from sendpath.native import build_extension, prefer
from sendpath.telemetry.export import Tracing
from sendpath.telemetry.genai import request_attributes, span_name, usage_attributes
from sendpath.telemetry.otlp import SpanTree, encode_tree
from sendpath.telemetry.spans import AttributeValue, SpanRecord
from sendpath.trace import Stage

__all__ = [
    "SpanExport",
    "encoded_spans",
    "gateway_span",
    "native_spans",
    "prefer_native",
    "span_error",
]

BATCH = 32  # requests whose spans are built in one go (SpanExport)
FLUSH_S = 0.05  # and how long the first of them waits at most
HOLD_TOKENS = 65_536  # or until their prompts add up to this (a context holds its body)

logger = logging.getLogger("sendpath.gateway")

# the gateway's own stages, as child spans (the replica's are the replica's spans)
_OWN = {
    stage: stage.value
    for stage in (
        Stage.GATEWAY_AUTH,
        Stage.GATEWAY_RATELIMIT,
        Stage.GATEWAY_SAFETY,
        Stage.GATEWAY_QUEUE,
        Stage.ROUTE,
        Stage.STREAM,
    )
}

# what the trace says of the route's choice (the page and the response say the rest)
_ROUTING = ("policy", "match", "predicted_cached_tokens", "runs_on")


def gateway_span(ctx: GatewayContext, operation: str, end: float) -> SpanRecord:
    """The request's span tree; ``end``: when its response ended, if it did not finish
    an answer (a refusal, an error)."""
    end = ctx.end if ctx.end is not None else end
    attributes = request_attributes(operation, ctx.body)
    attributes.update(_answer_attributes(ctx))
    root = SpanRecord(
        span_name(operation, _model(attributes)),
        ctx.start,
        end,
        "server",
        attributes,
        error=span_error(ctx),
    )
    stages = ctx.final[0] if ctx.final is not None else ctx.stage_seconds()
    begin, own = ctx.start, _OWN
    root.stages = [
        (own[stage], begin + start, begin + start + duration)
        for stage, start, duration in stages
        if stage in own
    ]
    root.children = [_attempt_span(attempt, end) for attempt in ctx.attempts]
    return root


def _model(attributes: dict[str, AttributeValue]) -> str | None:
    model = attributes.get("gen_ai.request.model")
    return model if isinstance(model, str) else None


def span_error(ctx: GatewayContext) -> str | None:
    """The request's ``error.type``: why a started answer did not end well, else its
    status code when that is an error (``None``: it succeeded)."""
    if ctx.error_type is not None:
        return ctx.error_type
    if ctx.status is None:
        return "internal_error"  # the app raised before it answered
    return str(ctx.status) if ctx.status >= 400 else None


def _answer_attributes(ctx: GatewayContext) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {"sendpath.request_id": ctx.request_id}
    if ctx.status is not None:
        out["http.response.status_code"] = ctx.status
    if ctx.key is not None:
        out["sendpath.key.name"] = ctx.key.name
    if ctx.client_id is not None:
        out["sendpath.client_id"] = ctx.client_id
    if ctx.response_id is not None:
        out["gen_ai.response.id"] = ctx.response_id
    if ctx.finish_reasons:
        out["gen_ai.response.finish_reasons"] = list(ctx.finish_reasons)
    out.update(usage_attributes(ctx.usage, ctx.cached_tokens))
    if ctx.first_token_at is not None:
        after = ctx.first_token_at - ctx.start  # to the microsecond (spans_native.c: rint)
        out["gen_ai.response.time_to_first_chunk"] = round(after * 1e6) / 1e6
    if ctx.first_token_held is not None:
        out["sendpath.first_token_held"] = ctx.first_token_held
    if ctx.replica_name is not None:
        out["sendpath.replica"] = ctx.replica_name
    routing = ctx.routing or {}
    for name in _ROUTING:
        value = routing.get(name)
        if isinstance(value, str | int) and not isinstance(value, bool):
            out[f"sendpath.routing.{name}"] = value
    return out


def _attempt_span(attempt: AttemptRecord, end: float) -> SpanRecord:
    attributes: dict[str, AttributeValue] = {
        "sendpath.replica": attempt.replica,
        "url.full": attempt.url,  # the operator's view: clients never see it
    }
    error = attempt.error
    if attempt.status is not None:
        attributes["http.response.status_code"] = attempt.status
        if error is None and attempt.status >= 400:
            error = str(attempt.status)
    return SpanRecord(
        f"attempt {attempt.replica}",
        attempt.start,
        attempt.end if attempt.end is not None else end,
        "client",
        attributes,
        span_id=attempt.span_id or None,
        error=error,
    )


_native: ModuleType | None = None  # spans_native.c, once ``prefer_native`` loaded it


def native_spans() -> ModuleType:
    """``spans_native.c``, built here on first use; raises ``NativeBuildError`` saying
    why it cannot be."""
    wire = Path(__file__).parent.parent / "telemetry" / "otlp_wire.c"
    return build_extension(
        "_sendpath_gateway_spans", [Path(__file__).with_name("spans_native.c"), wire]
    )


def prefer_native(native: bool = True) -> str:
    """Build spans in C from now on where it can be built (``native=False``: in Python);
    says which and, for Python, why."""
    global _native
    _native, how = prefer(native_spans, "gateway/spans_native.c") if native else (None, "in Python")
    return how


def encoded_spans(ctx: GatewayContext, operation: str, end: float, offset: float) -> bytes:
    """The request's spans (``gateway_span``'s tree) as OTLP bytes: in one C call where
    ``prefer_native`` loaded it, else built and encoded here; ``offset`` turns the
    clock's readings into Unix time. The request's trace must be set."""
    trace, caller = ctx.trace, ctx.parent_span_id
    assert trace is not None
    native = _native
    if native is None:
        root = gateway_span(ctx, operation, end)
        return encode_tree(
            SpanTree(root, trace.trace_id, trace.span_id, caller, trace.flags, offset)
        )
    spans: bytes = native.encode_gateway(
        ctx,
        operation,
        end,
        _OWN,
        trace.trace_id.to_bytes(16, "big"),
        trace.span_id.to_bytes(8, "big"),
        None if caller is None else caller.to_bytes(8, "big"),
        offset,
    )
    return spans


class SpanExport:
    """Where a gateway's finished requests' spans go (``tracing``). Encoded ones are made
    in C ``BATCH`` requests at a time, or ``FLUSH_S`` after the first of them, whichever
    comes first: from one to the next the C build's code stays in the CPU's caches, 6 µs
    a request in a loaded gateway instead of 10 one at a time. The requests' contexts
    wait that long, a few dozen at most and fewer when their prompts are long
    (``HOLD_TOKENS``: a context holds its request's body). Called from the event loop
    only; ``close`` at shutdown sends what waits, and later requests' spans go at once."""

    def __init__(self, tracing: Tracing, clock: Clock) -> None:
        self.tracing, self.clock = tracing, clock
        self._pending: list[tuple[GatewayContext, str, float, float]] = []
        self._held_tokens = 0  # the waiting requests' prompt estimates, summed
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def ended(self, ctx: GatewayContext, operation: str, end: float) -> None:
        """A request's response ended at ``end``: its spans, if its trace is sampled."""
        trace, tracing = ctx.trace, self.tracing
        if trace is None or not trace.sampled:
            return
        if not tracing.encoded:
            tracing.emit(gateway_span(ctx, operation, end), trace, ctx.parent_span_id, self.clock)
            return
        if ctx.end is None:  # its stages end here, not when the batch is built
            ctx.end = end
        pending = self._pending
        pending.append((ctx, operation, end, tracing.unix_offset(self.clock)))
        self._held_tokens += ctx.prompt_tokens
        if (
            _native is None  # nothing to gain from waiting
            or self._closed
            or len(pending) >= BATCH
            or self._held_tokens > HOLD_TOKENS
        ):
            self.flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop here: at once
            self.flush()
            return
        if self._timer is None or self._timer_loop is not loop:  # (a stopped loop's is not)
            self._timer, self._timer_loop = loop.call_later(FLUSH_S, self.flush), loop

    def flush(self) -> None:
        """Encode and queue what waits."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_loop = None
        pending, self._pending, self._held_tokens = self._pending, [], 0
        for ctx, operation, end, offset in pending:
            try:
                self.tracing.emit_encoded(encoded_spans(ctx, operation, end, offset))
            except Exception:  # a trace is never worth a request, nor another's trace
                logger.exception("request %s: its spans could not be exported", ctx.request_id)

    def close(self) -> None:
        """Send what waits; from now on each request's spans go at once."""
        self._closed = True
        self.flush()
