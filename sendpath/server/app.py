"""The replica's HTTP app: OpenAI-compatible endpoints over one async engine.

The model loads in the background after the server starts. ``/health`` says whether the
process is alive (200 while loading, serving or draining; 503 once the engine failed, or
is stuck in one step for over ``stuck_step_s``), ``/ready`` whether it takes requests now
(200 only when loaded, stepping and not draining): a balancer routes on ``/ready``.
``/load`` and ``/metrics`` answer from the engine's last snapshot, never waiting for a
step. Requests are read by ``protocol.py`` (the shared schema, published in
``/openapi.json``) and answered by ``generate.py``; the replica's state (engine, status,
traces) is ``replica.py``. With an API key
(``ReplicaConfig.api_key``), ``/v1/*``, ``/tokenize`` and ``/detokenize`` need it.

If the engine stops while serving (the device failed: a request's own failure never stops
it) or is stuck, ``on_engine_failure`` is called once, so ``sendpath replica`` exits and
``sendpath serve`` starts it again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from sendpath.api.errors import RequestIdMiddleware, install_error_handlers, send_error
from sendpath.api.json_body import load_json
from sendpath.api.openapi import publish_request_schemas
from sendpath.api.schema import (
    DEFAULT_CAP_HEADER,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    validate,
)
from sendpath.config import ReplicaConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore
from sendpath.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
    TraceNotFoundError,
)
from sendpath.server.choices import serve_choices
from sendpath.server.generate import serve_generation
from sendpath.server.protocol import parse_chat, parse_completion
from sendpath.server.replica import Replica, served_name
from sendpath.server.tools import chat_messages, template_tools

__all__ = ["Replica", "create_app", "served_name"]  # the first and last from replica.py

logger = logging.getLogger("sendpath.replica")


PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # what --api-key guards
LARGE_BODY = 256 * 1024  # parsed on a worker thread above this, not on the event loop


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on the protected paths (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith(PROTECTED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = AuthenticationError(
                    "This replica needs its API key: send 'Authorization: Bearer <key>' "
                    "(the key it was started with, --api-key or $SENDPATH_API_KEY)."
                )
                await send_error(send, error, {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


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


def create_app(
    config: ReplicaConfig,
    engine: AsyncEngine | None = None,
    on_engine_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """The replica app; pass ``engine`` to serve an already built one (tests)."""
    replica = Replica(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None if replica.engine is not None else asyncio.create_task(replica.load())
        watch = None
        if on_engine_failure is not None:
            watch = asyncio.create_task(replica.watch(on_engine_failure))
        yield
        replica.draining = True
        for task in (loading, watch):
            if task is not None and not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        if replica.engine is not None:
            await asyncio.to_thread(replica.engine.shutdown)
        logger.info("replica %s stopped: engine shut down", replica.model_name)

    app = FastAPI(title="sendpath replica", lifespan=lifespan)
    app.state.replica = replica
    install_error_handlers(app, config.retry_after_s)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Alive: 200 unless the engine failed or is stuck (503)."""
        status = replica.status
        bad = status in ("failed", "stuck")
        return JSONResponse({"status": status}, status_code=503 if bad else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Takes requests now: 200 only when loaded, running and not draining."""
        status = replica.status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        """Running, waiting and KV usage as of the engine's last step."""
        stats = replica.ready_engine().snapshot
        runs = replica.runs_on()
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "precision": {
                k: runs.get(k)
                for k in ("dtype", "quantization", "precision_reason", "decode_attention")
            },
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = replica.engine.snapshot if replica.engine is not None else None
        return Response(replica.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/steps")
    async def steps(after: int = 0) -> dict[str, Any]:
        """The engine's recent steps (shape and wall time) after step ``after``, with the
        engine settings they ran under: what `sendpath profile --url` fits."""
        engine = replica.ready_engine()
        found: dict[str, Any] = await asyncio.wrap_future(engine.call(lambda c: _steps(c, after)))
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

    async def tokens_body(request: Request, schema: type[TokenizeBody | DetokenizeBody]) -> Any:
        """A /tokenize or /detokenize body, checked, for this replica's model."""
        body = validate(schema, load_json(await _read_body(request, config.max_body_bytes)))
        if body.model is not None and body.model != replica.model_name:
            raise ModelNotFoundError(body.model, replica.model_name)
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """A prompt, or a chat's messages through the chat template, to token ids (vLLM's
        endpoint): how a gateway counts a prompt exactly before reserving it."""
        engine = replica.ready_engine()
        body: TokenizeBody = await tokens_body(request, TokenizeBody)
        tokenizer = engine.core.tokenizer
        if body.messages is not None:
            messages = chat_messages(body.messages)  # with their tools, as a chat renders them
            tools = template_tools(body.tools) if body.tools else None
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages, True, tools)
        elif body.prompt is not None:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            raise InvalidRequestError("Send 'prompt' or 'messages'.", param="prompt")
        return {"count": len(ids), "max_model_len": engine.core.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """Token ids to text (vLLM's endpoint): what a gateway's input filter reads of a
        token-id prompt. Ids outside the vocabulary are refused (400)."""
        engine = replica.ready_engine()
        body: DetokenizeBody = await tokens_body(request, DetokenizeBody)
        tokenizer = engine.core.tokenizer
        vocab = tokenizer.vocab_size
        if bad := [t for t in body.tokens if t >= vocab]:
            raise InvalidRequestError(
                f"Token id {bad[0]} is outside this model's vocabulary (0 to {vocab - 1}).",
                param="tokens",
            )
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)  # specials too
        return {"prompt": text}

    async def generation(request: Request, parse: Callable[[bytes, int], Any]) -> Response:
        engine = replica.ready_engine()
        raw = await _read_body(request, config.max_body_bytes)
        max_len = engine.core.max_model_len
        if len(raw) > LARGE_BODY:  # parsed on a worker thread, not on the event loop
            parsed = await asyncio.to_thread(parse, raw, max_len)
        else:
            parsed = parse(raw, max_len)
        if parsed.model != replica.model_name:  # before anything runs, for one answer or n
            raise ModelNotFoundError(parsed.model, replica.model_name)
        if request.headers.get(DEFAULT_CAP_HEADER) == "default":
            parsed.max_tokens_given = False  # a gateway's cap: stop at the context's end
        if parsed.n > 1:
            return await serve_choices(replica, engine, parsed, request)
        return await serve_generation(replica, engine, parsed, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generation(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, parse_completion)

    publish_request_schemas(
        app,
        {
            "/v1/chat/completions": ChatBody,
            "/v1/completions": CompletionBody,
            "/tokenize": TokenizeBody,
            "/detokenize": DetokenizeBody,
        },
    )
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware)
    return app


def _steps(core: EngineCore, after: int) -> dict[str, Any]:
    sched, kv = core.scheduler, core.scheduler.kv
    describe = getattr(core.runner, "describe", None)  # the model runner's
    runs_on = describe() if describe is not None else {}
    return {
        "engine": {
            "device": runs_on.get("device", "unknown device"),
            "dtype": runs_on.get("dtype"),
            "quantization": runs_on.get("quantization"),
            "decode_attention": runs_on.get("decode_attention"),
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
