"""The gateway's ``/v1/`` routes besides generation: models, traces, progress, what-if.

They run behind the middleware stack, so a key is checked first when keys are required;
a trace or a progress report is only shown to the key whose request it is. The two
generation routes are here to publish their schema: ``ForwardMiddleware`` answers those
requests before the app's routing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sendpath.errors import ServiceUnavailableError, TraceNotFoundError
from sendpath.gateway.context import context
from sendpath.gateway.middleware import live_key
from sendpath.gateway.parts import parts_of
from sendpath.gateway.tracing import progress_of, stitch

__all__ = ["WHATIF_WAIT_S", "router"]

WHATIF_WAIT_S = 10.0  # a what-if waits this long for the one running before it, then 503

router = APIRouter()


def _key_name(request: Request) -> str | None:
    """Whose request it is: a trace or a progress report is only shown to its key."""
    key = context(request.scope).key
    return key.name if key else None


@router.get("/v1/traces/{response_id}")
async def trace(response_id: str, request: Request) -> JSONResponse:
    """A finished request's timeline, stitched with its replica's own trace."""
    parts = parts_of(request)
    found = parts.traces.get(response_id)
    if found is None or found.key != _key_name(request):
        raise TraceNotFoundError(response_id)  # another key's trace does not exist
    replica_trace = None
    endpoint = parts.pool.by_url(found.replica_url) if found.replica_url else None
    if endpoint is not None:
        try:
            r = await parts.client.get(
                f"{endpoint.url}/v1/traces/{response_id}", headers=endpoint.headers
            )
            replica_trace = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            replica_trace = None
    return JSONResponse(stitch(found, replica_trace))


@router.get("/v1/progress/{client_id}")
async def progress(client_id: str, request: Request) -> dict[str, Any]:
    """The stage an in-flight request is in now (for the page's live pipeline)."""
    parts = parts_of(request)
    found = parts.live.get(live_key(_key_name(request), client_id))
    if found is None:
        raise TraceNotFoundError(client_id)
    endpoint = parts.pool.by_url(found.replica) if found.replica else None
    headers = endpoint.headers if endpoint is not None else {}
    return await progress_of(found, client_id, parts.client, headers)


@router.get("/v1/whatif")
async def whatif(
    request: Request, rate: float = 1.0, prompt: int = 256, answer: int = 256, replicas: int = 1
) -> dict[str, Any]:
    """The page's "what if": the simulator's stage shares for this traffic (Llama-3.1-8B
    on H100s). Bounded work, one at a time per gateway process, off the event loop."""
    from sendpath.sim.whatif import what_if

    slot = parts_of(request).whatif_slot
    try:
        async with asyncio.timeout(WHATIF_WAIT_S):
            await slot.acquire()
    except TimeoutError:
        raise ServiceUnavailableError(
            "Another what-if simulation is running; retry in a moment."
        ) from None
    try:
        return await asyncio.to_thread(what_if, rate, prompt, answer, replicas)
    finally:
        slot.release()


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The model list of the first healthy replica that answers."""
    parts = parts_of(request)
    for endpoint in parts.pool.candidates():
        try:
            upstream = await parts.client.get(
                endpoint.url + "/v1/models", headers=endpoint.headers, timeout=5.0
            )
        except httpx.HTTPError as exc:
            parts.router.failed(endpoint, f"{type(exc).__name__} on /v1/models")
            continue
        if upstream.status_code == 200:
            return Response(upstream.content, 200, media_type="application/json")
    raise ServiceUnavailableError("No healthy replica to ask; retry in a moment.")


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await parts_of(request).proxy.forward(request)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await parts_of(request).proxy.forward(request)
