"""The gateway's open routes: ``/health``, the page, ``/fleet`` and ``/metrics``.

Operator views: they name replica URLs; nothing sent to a client about its own request
does. Everything under ``/v1/`` is in ``routes_api.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sendpath.gateway.parts import GatewayParts, parts_of

__all__ = ["WEB", "router"]

WEB = Path(__file__).parent.parent / "web"  # the page: plain HTML, CSS and JavaScript

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while any replica is healthy (503 else), with each replica's state."""
    parts = parts_of(request)
    endpoints = parts.pool.endpoints
    healthy = sum(e.healthy for e in endpoints)
    replicas = [
        {"name": e.name, "url": e.url, "healthy": e.healthy, "in_flight": e.in_flight,
         "load": e.load}
        for e in endpoints
    ]  # fmt: skip
    return JSONResponse(
        {
            "status": "ok" if healthy else "unavailable",
            "healthy": healthy,
            "policy": parts.router.policy.name,
            "in_flight": parts.queue.num_in_flight,
            "waiting": parts.queue.num_waiting,
            "replicas": replicas,
        },
        status_code=200 if healthy else 503,
    )


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(WEB / "index.html")


@router.get("/fleet")
async def fleet(request: Request) -> dict[str, Any]:
    """The gateway's queue and each replica's health, load and process, for the page."""
    parts = parts_of(request)
    processes = parts.fleet_status() if parts.fleet_status is not None else {}
    replicas = []
    for e in parts.pool.endpoints:
        s = e.stats
        queries = s.get("prefix_cache_queries", 0.0)
        replicas.append(
            {
                "name": e.name,
                "url": e.url,
                "healthy": e.healthy,
                "in_flight": e.in_flight,
                "running": int(s["num_requests_running"]) if s else None,
                "waiting": int(s["num_requests_waiting"]) if s else None,
                "kv_cache_usage": s.get("kv_cache_usage"),
                "prefix_cache_hit_rate": (
                    s.get("prefix_cache_hits", 0.0) / queries if queries else None
                ),
                "prefix_routing": _prefix_routing(parts, e.index),
                "runs_on": e.where or None,  # a cluster engine's node and host
                **processes.get(e.url, {}),
            }
        )
    return {
        "gateway": {
            "in_flight": parts.queue.num_in_flight,
            "waiting": parts.queue.num_waiting,
            "capacity": parts.queue.capacity,
            "policy": parts.router.policy.name,
        },
        "replicas": replicas,
    }


def _prefix_routing(parts: GatewayParts, replica: int) -> dict[str, Any]:
    """How the router matches prefixes on this replica: precise (following its KV events:
    the last batch applied, the blocks it holds) or approximate."""
    follower = parts.follower
    if follower is None or replica not in follower.following:
        return {"mode": "approximate"}
    return {
        "mode": "precise",
        "events_applied": follower.applied.get(replica, -1) + 1,
        "blocks_held": follower.index.num_blocks(replica),
    }


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(parts_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
