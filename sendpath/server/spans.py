"""A finished request's spans on the replica, from its engine requests' event lists.

One server span per HTTP request, ``{operation} {model}``, a child of the ``traceparent``
it came with (the gateway's attempt span), from the first engine event to the last; under
it each choice's stages as the trace counts them: ``tokenize`` (arrival to the queue),
``engine.queue`` (to the first scheduling), ``prefill`` (to the first token) and
``decode`` (to the finish). A preemption is an event on the choice's ``decode`` (or
``prefill``) span: its time back in the queue stays inside that span, as the engine's own
stage table counts it in ``engine.queue``.
"""

from __future__ import annotations

from sendpath.request import Request as EngineRequest
from sendpath.server.protocol import ParsedRequest
from sendpath.server.responses import usage
from sendpath.telemetry.genai import request_attributes, span_name, usage_attributes
from sendpath.telemetry.spans import SpanRecord
from sendpath.trace import EventType, Stage

__all__ = ["OPERATIONS", "extent", "replica_span"]

OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def extent(requests: list[EngineRequest]) -> tuple[float, float] | None:
    """From the first engine event of ``requests`` to their last (``None``: none yet)."""
    events = [r.timeline.events for r in requests if r.timeline.events]
    if not events:
        return None
    return min(e[0].time for e in events), max(e[-1].time for e in events)


def replica_span(
    parsed: ParsedRequest, requests: list[EngineRequest], response_id: str, reasons: list[str]
) -> SpanRecord | None:
    """The span tree of an answered request (``None``: its engine recorded nothing)."""
    lasted = extent(requests)
    if lasted is None:
        return None
    operation = OPERATIONS[parsed.kind]
    p = parsed.params
    body = {
        "model": parsed.model, "max_tokens": p.max_tokens, "temperature": p.temperature,
        "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed, "stop": p.stop, "n": parsed.n,
        "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
    }  # fmt: skip
    attributes = request_attributes(operation, body)
    attributes["gen_ai.response.id"] = response_id
    attributes["gen_ai.response.model"] = parsed.model
    attributes["gen_ai.response.finish_reasons"] = list(reasons)
    counted = usage(*requests)
    attributes.update(
        usage_attributes(
            (counted["prompt_tokens"], counted["completion_tokens"]),
            counted["prompt_tokens_details"]["cached_tokens"],
        )
    )
    ttft = requests[0].timeline.ttft
    if ttft is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = round(ttft, 6)
    root = SpanRecord(span_name(operation, parsed.model), *lasted, "server")
    root.attributes = attributes
    for index, request in enumerate(requests):
        root.children += _stages(request, index if len(requests) > 1 else None)
    return root


def _stages(request: EngineRequest, choice: int | None) -> list[SpanRecord]:
    tl = request.timeline
    arrived, first = tl.first(EventType.ARRIVED), tl.first(EventType.FIRST_TOKEN)
    queued = tl.first(EventType.QUEUED) or tl.first(EventType.TOKENIZED)
    scheduled, end = tl.first(EventType.SCHEDULED), tl.end
    marks = [
        (Stage.TOKENIZE, arrived, queued),
        (Stage.ENGINE_QUEUE, queued, scheduled),
        (Stage.PREFILL, scheduled, first if first is not None else end),
        (Stage.DECODE, first, end),
    ]
    spans = [
        SpanRecord(stage.value, start, stop)
        for stage, start, stop in marks
        if start is not None and stop is not None
    ]
    for span in spans:
        if choice is not None:
            span.attributes["gen_ai.response.choice.index"] = choice
        span.events = [
            ("preempted", e.time)
            for e in tl.events
            if e.type is EventType.PREEMPTED and span.start <= e.time <= span.end
        ]
    return spans
