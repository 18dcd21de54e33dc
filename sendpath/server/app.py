"""The replica's HTTP app: OpenAI-compatible endpoints over one async engine.

The model loads in the background after the server starts, so ``/health`` can say 503
while loading (and while draining at shutdown). Each request is parsed from its raw body
(``protocol.py``), queued in the engine (errors become OpenAI error bodies with the right
status), then answered as one JSON body or as server-sent events. A client that goes away
aborts its request wherever it is, which frees its slot and KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sendpath.config import ReplicaConfig
from sendpath.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from sendpath.engine.core import EngineCore
from sendpath.errors import (
    ModelNotFoundError,
    RequestTooLargeError,
    SendpathError,
    ServiceUnavailableError,
    TraceNotFoundError,
)
from sendpath.request import Request as EngineRequest
from sendpath.server.metrics import ReplicaMetrics
from sendpath.server.protocol import ParsedRequest, parse_chat, parse_completion
from sendpath.server.responses import Chunker, error_body, server_timing, sse, timings_ms
from sendpath.trace import TraceStore, event_log

__all__ = ["Replica", "create_app", "served_name"]

logger = logging.getLogger("sendpath.replica")


def served_name(config: ReplicaConfig) -> str:
    """The model id clients send: the flag, else the file or directory name."""
    if config.served_model_name:
        return config.served_model_name
    if config.engine.model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(config.engine.model)
    return path.stem if path.suffix == ".gguf" else path.name


class Replica:
    """The app's state: the engine once loaded, and whether it takes requests."""

    def __init__(self, config: ReplicaConfig, engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.model_name = served_name(config)
        self.engine = engine
        self.draining = False
        self.load_error: BaseException | None = None
        self.metrics = ReplicaMetrics()
        self.traces: TraceStore[dict[str, Any]] = TraceStore()
        self.active: TraceStore[EngineRequest] = TraceStore()  # in flight, by response id

    def finished(self, response_id: str, request: EngineRequest) -> None:
        """Record a finished request: metrics, and its trace for ``/v1/traces/{id}``."""
        self.metrics.observe(request)
        events = request.timeline.events
        self.traces.put(
            response_id,
            {
                "id": response_id,
                "object": "replica.trace",
                "clock": events[0].time if events else None,
                "timings": timings_ms(request),
                "events": event_log(request.timeline),
            },
        )

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.load_error is not None or (self.engine is not None and not self.engine.is_running):
            return "failed"
        return "ok" if self.engine is not None else "loading"

    async def load(self) -> None:
        try:
            core = await asyncio.to_thread(EngineCore.from_config, self.config.engine)
        except BaseException as exc:
            self.load_error = exc
            logger.error("the model could not be loaded, /health says 'failed': %s", exc)
            return
        self.engine = AsyncEngine(core)

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None or self.status != "ok":
            raise ServiceUnavailableError(f"The server is {self.status}; retry in a moment.")
        return self.engine


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLargeError(len(body), limit)
    return bytes(body)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(config: ReplicaConfig, engine: AsyncEngine | None = None) -> FastAPI:
    """The replica app; pass ``engine`` to serve an already built one (tests)."""
    replica = Replica(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None if replica.engine is not None else asyncio.create_task(replica.load())
        yield
        replica.draining = True
        if loading is not None and not loading.done():
            loading.cancel()
        if replica.engine is not None:
            await asyncio.to_thread(replica.engine.shutdown)
        logger.info("replica %s stopped: engine shut down", replica.model_name)

    app = FastAPI(title="sendpath replica", lifespan=lifespan)
    app.state.replica = replica

    @app.exception_handler(SendpathError)
    async def sendpath_error(request: Request, exc: SendpathError) -> JSONResponse:
        headers = {"Retry-After": str(config.retry_after_s)} if exc.status_code == 503 else None
        return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return await sendpath_error(request, ServiceUnavailableError(str(exc)))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": replica.status}, status_code=200 if replica.status == "ok" else 503
        )

    @app.get("/load")
    async def load() -> dict[str, Any]:
        stats = await replica.ready_engine().stats()
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await replica.engine.stats() if replica.engine is not None else None
        return Response(replica.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/steps")
    async def steps(after: int = 0) -> dict[str, Any]:
        """The engine's recent steps (shape and wall time) after step ``after``, with the
        engine settings they ran under: what `sendpath profile --url` fits."""
        engine = replica.ready_engine()

        def read(core: EngineCore) -> dict[str, Any]:
            sched, kv = core.scheduler, core.scheduler.kv
            describe = getattr(core.runner, "describe", None)  # the model runner's
            runs_on = describe() if describe is not None else {}
            return {
                "engine": {
                    "device": runs_on.get("device", "unknown device"),
                    "dtype": runs_on.get("dtype"),
                    "max_num_seqs": sched.config.max_num_seqs,
                    "max_num_batched_tokens": sched.config.max_num_batched_tokens,
                    "block_size": kv.block_size,
                    "num_blocks": kv.pool.num_blocks,
                    "max_model_len": core.max_model_len,
                },
                "steps": [
                    {"seq": r.seq, "start": r.start, "seconds": r.seconds,
                     "busy_after": r.busy_after, **asdict(r.shape)}
                    for r in core.steps.since(after)
                ],
            }  # fmt: skip

        found: dict[str, Any] = await asyncio.wrap_future(engine.call(read))
        return found

    @app.get("/v1/requests/{response_id}")
    async def progress(response_id: str) -> dict[str, Any]:
        """Where an in-flight request is in the engine (read while the engine runs)."""
        request = replica.active.get(response_id)
        if request is None:
            raise TraceNotFoundError(response_id)
        return {
            "id": response_id,
            "status": request.status.value,
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_computed_tokens": min(request.num_computed_tokens, request.num_prompt_tokens),
            "num_output_tokens": len(request.output_token_ids),
        }

    @app.get("/v1/traces/{response_id}")
    async def trace(response_id: str) -> JSONResponse:
        found = replica.traces.get(response_id)
        if found is None:
            raise TraceNotFoundError(response_id)
        return JSONResponse(found)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": replica.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "sendpath",
        }
        if replica.engine is not None:
            card["max_model_len"] = replica.engine.core.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        engine = replica.ready_engine()
        raw = await _read_body(request, config.max_body_bytes)
        return await _serve(replica, engine, parse_chat(raw, engine.core.max_model_len), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        engine = replica.ready_engine()
        raw = await _read_body(request, config.max_body_bytes)
        parsed = parse_completion(raw, engine.core.max_model_len)
        return await _serve(replica, engine, parsed, request)

    return app


async def _serve(
    replica: Replica, engine: AsyncEngine, parsed: ParsedRequest, request: Request
) -> Response:
    if parsed.model != replica.model_name:
        raise ModelNotFoundError(parsed.model, replica.model_name)
    stream = await engine.add(
        parsed.prompt,
        parsed.params,
        priority=parsed.priority,
        cache_salt=parsed.cache_salt,
        strict_max_tokens=parsed.max_tokens_given,
    )
    prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
    chunker = Chunker(
        parsed.kind, f"{prefix}-{uuid.uuid4().hex}", replica.model_name, int(time.time())
    )
    # the engine's arrival on this host's monotonic clock: a gateway on the same host
    # stitches this replica's events into its own timeline exactly
    arrival = stream.request.timeline.events[0].time
    headers = {"x-request-id": chunker.id, "x-sendpath-clock": repr(arrival)}
    replica.active.put(chunker.id, stream.request)
    if parsed.stream:
        events = _events(replica, stream, chunker, parsed.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    collect = asyncio.create_task(_collect(stream))
    gone = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        replica.active.pop(chunker.id)
        if not collect.done():  # the client left (or this handler was cancelled)
            collect.cancel()
            stream.abort()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    text, last = collect.result()
    replica.finished(chunker.id, stream.request)
    body = chunker.body(text, last, stream.request)
    headers["Server-Timing"] = server_timing(body["timings"])
    return JSONResponse(body, headers=headers)


async def _collect(stream: RequestStream) -> tuple[str, Any]:
    text, last = "", None
    async for out in stream:
        text, last = text + out.text, out
    if last is None or last.finish_reason == "abort":
        raise EngineDeadError("the request was aborted before it finished")
    return text, last


async def _events(
    replica: Replica, stream: RequestStream, chunker: Chunker, include_usage: bool
) -> AsyncIterator[str]:
    """SSE: a role chunk, one chunk per text delta, the finish chunk, usage, [DONE]."""
    try:
        if chunker.kind == "chat":
            yield sse(chunker.chunk("", role=True))
        async for out in stream:
            if out.text:
                yield chunker.delta_sse(out.text)
            if not out.finished:
                continue
            if out.finish_reason == "abort":
                raise EngineDeadError("the request was aborted before it finished")
            final = chunker.chunk(None, str(out.finish_reason))
            timings = timings_ms(stream.request)
            if include_usage:
                yield sse(final)
                final = chunker.usage_chunk(stream.request)
            final["timings"] = timings
            yield sse(final)
            yield "data: [DONE]\n\n"
            replica.finished(chunker.id, stream.request)
    except (EngineDeadError, SendpathError) as exc:
        err = exc if isinstance(exc, SendpathError) else ServiceUnavailableError(str(exc))
        yield sse(error_body(err))  # an explicit error event, and no [DONE]
    finally:
        replica.active.pop(chunker.id)
        if not stream.finished:
            stream.abort()
