"""One request's trace as the gateway keeps it, and the stitched timeline it serves.

When a request finishes, the gateway keeps a compact ``GatewayTrace`` (its stages on the
gateway's timeline, when each text chunk went out, which replica answered); the body is
not kept. ``GET /v1/traces/{id}`` stitches it with the replica's own trace (its events,
one per generated token among them) by placing the replica's arrival where the gateway
saw it, so every time in the answer is milliseconds since the request reached the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sendpath.gateway.context import GatewayContext

__all__ = ["GatewayTrace", "record", "stitch"]


@dataclass(frozen=True)
class GatewayTrace:
    id: str
    key: str | None  # the key name that may read it (None: made without a key)
    model: str | None
    replica: str | None
    created: int
    stages: list[tuple[str, float, float]]  # stage, start ms, duration ms
    timings: dict[str, float]
    relayed_ms: list[float]  # when each text chunk was written to the client
    replica_offset_ms: float | None  # the replica's arrival on this timeline
    usage: tuple[int, int] | None


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def record(ctx: GatewayContext) -> GatewayTrace:
    """The trace of a finished request."""
    assert ctx.response_id is not None
    model = ctx.body.get("model") if ctx.body else None
    return GatewayTrace(
        id=ctx.response_id,
        key=ctx.key.name if ctx.key else None,
        model=model if isinstance(model, str) else None,
        replica=ctx.replica,
        created=int(time.time()),
        stages=[(s.value, _ms(start), _ms(d)) for s, start, d in ctx.stage_seconds()],
        timings=ctx.timings_ms(),
        relayed_ms=[_ms(t - ctx.start) for t in ctx.relayed],
        replica_offset_ms=(
            None if ctx.replica_arrival is None else _ms(ctx.replica_arrival - ctx.start)
        ),
        usage=ctx.usage,
    )


def stitch(trace: GatewayTrace, replica: dict[str, Any] | None) -> dict[str, Any]:
    """The full timeline: stages, per-token times and events, in ms since arrival."""
    events: list[dict[str, Any]] = [
        {"type": "arrived", "t_ms": 0.0, "where": "gateway"},
    ]
    events += [
        {"type": f"{stage}.end", "t_ms": round(start + dur, 3), "where": "gateway"}
        for stage, start, dur in trace.stages
        if stage.startswith("gateway.")
    ]
    tokens: list[float] | None = None
    if replica is not None and trace.replica_offset_ms is not None:
        offset = trace.replica_offset_ms
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
            {"stage": stage, "start_ms": start, "duration_ms": dur}
            for stage, start, dur in trace.stages
        ],
        "timings": trace.timings,
        "tokens_ms": tokens,  # None: the replica kept no trace (another server, or too old)
        "relayed_ms": trace.relayed_ms,
        "events": sorted(events, key=lambda e: e["t_ms"] if e["t_ms"] is not None else 0.0),
    }
    if trace.usage is not None:
        out["usage"] = {"prompt_tokens": trace.usage[0], "completion_tokens": trace.usage[1]}
    return out
