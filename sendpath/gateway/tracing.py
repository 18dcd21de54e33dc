"""One request's trace as the gateway keeps it, and the stitched timeline it serves.

When a request finishes, the gateway keeps a compact ``GatewayTrace`` (its stages on the
gateway's timeline, when each text chunk went out, which replica answered); the body is
not kept. ``GET /v1/traces/{id}`` stitches it with the replica's own trace (its events,
one per generated token among them) by placing the replica's arrival where the gateway
saw it, so every time in the answer is milliseconds since the request reached the gateway.

``progress_of`` says which stage a request is in while it runs (the page's live pipeline):
the gateway's own stages from its context, the engine's from the replica's
``/v1/requests/{id}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from sendpath.gateway.context import GATEWAY_STAGES, GatewayContext
from sendpath.trace import Stage

__all__ = ["GatewayTrace", "gateway_stage", "progress_of", "record", "stitch"]


@dataclass(frozen=True)
class GatewayTrace:
    """What is kept of a finished request, as it was measured: times on the gateway's
    clock (``stitch`` turns them into milliseconds since arrival when one is asked for)."""

    id: str
    key: str | None  # the key name that may read it (None: made without a key)
    model: str | None
    replica: str | None  # its name, as clients see it
    replica_url: str | None  # where to fetch the replica's own trace (internal)
    created: int
    start: float  # when the request arrived
    stages: list[tuple[Stage, float, float]]  # stage, start s (since arrival), duration s
    timings: dict[str, float]
    relayed: list[float]  # when each text chunk was written to the client
    replica_arrival: float | None  # the replica's arrival
    usage: tuple[int, int] | None
    cached_tokens: int | None = None  # what the replica said came from its cache
    routing: dict[str, Any] | None = None  # why it went there (``GatewayContext.routing``)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def record(
    ctx: GatewayContext,
    stages: list[tuple[Stage, float, float]],
    timings: dict[str, float] | None = None,
) -> GatewayTrace:
    """The trace of a finished request (``stages``: its ``ctx.stage_seconds()``;
    ``timings``: its ``ctx.timings_ms(stages)``, if already computed)."""
    assert ctx.response_id is not None
    model = ctx.body.get("model") if ctx.body else None
    return GatewayTrace(
        id=ctx.response_id,
        key=ctx.key.name if ctx.key else None,
        model=model if isinstance(model, str) else None,
        replica=ctx.replica_name,
        replica_url=ctx.replica,
        created=int(time.time()),
        start=ctx.start,
        stages=stages,
        timings=ctx.timings_ms(stages) if timings is None else timings,
        relayed=ctx.relayed,
        replica_arrival=ctx.replica_arrival,
        usage=ctx.usage,
        cached_tokens=ctx.cached_tokens,
        routing=ctx.routing,
    )


def stitch(trace: GatewayTrace, replica: dict[str, Any] | None) -> dict[str, Any]:
    """The full timeline: stages, per-token times and events, in ms since arrival."""
    stages = [(s.value, _ms(start), _ms(d)) for s, start, d in trace.stages]
    events: list[dict[str, Any]] = [
        {"type": "arrived", "t_ms": 0.0, "where": "gateway"},
    ]
    events += [
        {"type": f"{stage}.end", "t_ms": round(start + dur, 3), "where": "gateway"}
        for stage, start, dur in stages
        if stage.startswith("gateway.")
    ]
    tokens: list[float] | None = None
    if replica is not None and trace.replica_arrival is not None:
        offset = _ms(trace.replica_arrival - trace.start)
        shifted = [
            {**e, "t_ms": round(offset + float(e["t_ms"]), 3), "where": "replica"}
            for e in replica.get("events", [])
        ]
        events += shifted
        tokens = [e["t_ms"] for e in shifted if e["type"] == "token"]
    events.append({"type": "finished", "t_ms": trace.timings.get("total"), "where": "gateway"})
    out: dict[str, Any] = {
        "id": trace.id,
        "object": "trace",
        "created": trace.created,
        "model": trace.model,
        "replica": trace.replica,
        "stages": [
            {"stage": stage, "start_ms": start, "duration_ms": dur} for stage, start, dur in stages
        ],
        "timings": trace.timings,
        "tokens_ms": tokens,  # None: the replica kept no trace (another server, or too old)
        "relayed_ms": [_ms(t - trace.start) for t in trace.relayed],
        "events": sorted(events, key=lambda e: e["t_ms"] if e["t_ms"] is not None else 0.0),
    }
    if trace.usage is not None:
        out["usage"] = {"prompt_tokens": trace.usage[0], "completion_tokens": trace.usage[1]}
    if trace.routing is not None:  # predicted beside what the replica then reported
        out["routing"] = {**trace.routing, "cached_tokens": trace.cached_tokens}
    return out


def gateway_stage(ctx: GatewayContext) -> Stage:
    """The stage a request is in, as far as the gateway alone can tell: the one after the
    last gateway stage that ended (``route`` after them all)."""
    for stage in reversed(GATEWAY_STAGES):
        if stage in ctx.marks:
            after = GATEWAY_STAGES.index(stage) + 1
            return GATEWAY_STAGES[after] if after < len(GATEWAY_STAGES) else Stage.ROUTE
    return Stage.GATEWAY_AUTH


async def progress_of(
    ctx: GatewayContext, client_id: str, client: httpx.AsyncClient, headers: dict[str, str]
) -> dict[str, Any]:
    """Where an in-flight request is now: its stage, and the engine's progress on it."""
    out: dict[str, Any] = {"client_id": client_id, "stage": gateway_stage(ctx).value}
    if ctx.first_token_at is not None:
        out["stage"] = Stage.DECODE.value
        return out
    if ctx.replica is None or ctx.replica_request_id is None:
        return out
    out["stage"] = Stage.TOKENIZE.value
    try:
        r = await client.get(
            f"{ctx.replica}/v1/requests/{ctx.replica_request_id}", headers=headers, timeout=1.0
        )
        engine = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        engine = None
    if engine is None:
        return out
    out["engine"] = engine
    computed, prompt = engine["num_computed_tokens"], engine["num_prompt_tokens"]
    if engine["num_output_tokens"] > 0:
        out["stage"] = Stage.DECODE.value
    elif engine["status"] == "running" or computed > 0:
        out["stage"] = Stage.PREFILL.value
    else:
        out["stage"] = Stage.ENGINE_QUEUE.value
    out["prefill_done"] = round(computed / prompt, 3) if prompt else 0.0
    return out
