"""The replica's HTTP app: OpenAI-compatible endpoints over one async engine.

The model loads in the background after the server starts. Its routes: health, load and
what it knows of its requests (``routes_status.py``), generation (``routes_generate.py``:
requests read by ``protocol.py``, the shared schema published in ``/openapi.json``, and
answered by ``generate.py``), vLLM's tokenizer endpoints (``routes_tokens.py``); the
replica's state (engine, status, traces) is ``replica.py``. With an API key
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

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from sendpath.api.errors import RequestIdMiddleware, install_error_handlers, send_error
from sendpath.api.openapi import publish_request_schemas
from sendpath.api.schema import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from sendpath.config import ReplicaConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.errors import AuthenticationError
from sendpath.server import routes_generate, routes_status, routes_tokens
from sendpath.server.replica import Replica, served_name
from sendpath.telemetry.export import Tracing

__all__ = ["Replica", "create_app", "served_name"]  # the first and last from replica.py

logger = logging.getLogger("sendpath.replica")


PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # what --api-key guards


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


def create_app(
    config: ReplicaConfig,
    engine: AsyncEngine | None = None,
    on_engine_failure: Callable[[], None] | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The replica app; pass ``engine`` to serve an already built one (tests), ``tracing``
    to send its spans elsewhere than the config says."""
    replica = Replica(config, engine, tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None if replica.engine is not None else asyncio.create_task(replica.load())
        if loading is None:
            await replica.start_events()
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
        replica.stop_events()
        if replica.tracing is not None:
            await asyncio.to_thread(replica.tracing.shutdown)
        logger.info("replica %s stopped: engine shut down", replica.model_name)

    app = FastAPI(title="sendpath replica", lifespan=lifespan)
    app.state.replica = replica
    install_error_handlers(app, config.retry_after_s)
    for routes in (routes_status, routes_tokens, routes_generate):
        app.include_router(routes.router)
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
