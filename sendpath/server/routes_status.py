"""The replica's routes about itself: health, readiness, load, metrics, its engine's
recent steps, a request's progress and trace, and its model.

``/health`` says whether the process is alive (200 while loading, serving or draining;
503 once the engine failed, or is stuck in one step for over ``stuck_step_s``), ``/ready``
whether it takes requests now (200 only when loaded, stepping and not draining): a
balancer routes on ``/ready``. ``/load`` and ``/metrics`` answer from the engine's last
snapshot, never waiting for a step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sendpath.errors import TraceNotFoundError
from sendpath.server.replica import Replica

__all__ = ["replica_of", "router"]

router = APIRouter()


def replica_of(request: Request) -> Replica:
    """The replica the app serving ``request`` fronts."""
    replica: Replica = request.app.state.replica
    return replica


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Alive: 200 unless the engine failed or is stuck (503)."""
    status = replica_of(request).status
    bad = status in ("failed", "stuck")
    return JSONResponse({"status": status}, status_code=503 if bad else 200)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Takes requests now: 200 only when loaded, running and not draining."""
    status = replica_of(request).status
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/load")
async def load(request: Request) -> dict[str, Any]:
    """Running, waiting and KV usage as of the engine's last step."""
    return replica_of(request).load_report()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    replica = replica_of(request)
    stats = replica.engine.snapshot if replica.engine is not None else None
    return Response(replica.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/steps")
async def steps(request: Request, after: int = 0) -> dict[str, Any]:
    """The engine's recent steps (shape and wall time) after step ``after``, with the
    engine settings they ran under: what `sendpath profile --url` fits."""
    engine = replica_of(request).ready_engine()
    found: dict[str, Any] = await asyncio.wrap_future(engine.call(lambda c: c.step_log(after)))
    return found


@router.get("/v1/requests/{response_id}")
async def progress(response_id: str, request: Request) -> dict[str, Any]:
    """Where an in-flight request is in the engine (read while the engine runs)."""
    found = replica_of(request).active.get(response_id)
    if found is None:
        raise TraceNotFoundError(response_id)
    return {
        "id": response_id,
        "status": found.status.value,
        "num_prompt_tokens": found.num_prompt_tokens,
        "num_computed_tokens": min(found.num_computed_tokens, found.num_prompt_tokens),
        "num_output_tokens": len(found.output_token_ids),
    }


@router.get("/v1/traces/{response_id}")
async def trace(response_id: str, request: Request) -> JSONResponse:
    found = replica_of(request).traces.get(response_id)
    if found is None:
        raise TraceNotFoundError(response_id)
    return JSONResponse(found)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    replica = replica_of(request)
    card: dict[str, Any] = {
        "id": replica.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "sendpath",
    }
    if replica.engine is not None:
        card["max_model_len"] = replica.engine.core.max_model_len
    return {"object": "list", "data": [card]}
