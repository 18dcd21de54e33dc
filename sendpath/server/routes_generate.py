"""The replica's generation routes, ``/v1/chat/completions`` and ``/v1/completions``.

A body is read within ``max_body_bytes`` (413 past it), checked by ``protocol.py`` (the
shared schema; a large one on a worker thread, not on the event loop) and answered by
``generate.py`` (any ``n``: one choice is a fan-out of one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sendpath.api.json_body import read_body
from sendpath.api.schema import DEFAULT_CAP_HEADER
from sendpath.errors import ModelNotFoundError
from sendpath.server.generate import serve_generation
from sendpath.server.protocol import parse_chat, parse_completion
from sendpath.server.routes_status import replica_of

__all__ = ["LARGE_BODY", "router"]

LARGE_BODY = 256 * 1024  # parsed on a worker thread above this, not on the event loop

router = APIRouter()


async def _generation(request: Request, parse: Callable[[bytes, int], Any]) -> Response:
    replica = replica_of(request)
    engine = replica.ready_engine()
    raw = await read_body(request, replica.config.max_body_bytes)
    max_len = engine.core.max_model_len
    if len(raw) > LARGE_BODY:  # parsed on a worker thread, not on the event loop
        parsed = await asyncio.to_thread(parse, raw, max_len)
    else:
        parsed = parse(raw, max_len)
    if parsed.model != replica.model_name:  # before anything runs, for one answer or n
        raise ModelNotFoundError(parsed.model, replica.model_name)
    if request.headers.get(DEFAULT_CAP_HEADER) == "default":
        parsed.max_tokens_given = False  # a gateway's cap: stop at the context's end
    return await serve_generation(replica, engine, parsed, request)


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    return await _generation(request, parse_chat)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generation(request, parse_completion)
