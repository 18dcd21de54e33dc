"""The gateway's HTTP app: the middleware stack in front of the replica pool.

``create_gateway_app`` builds it from a ``GatewayConfig``. Several gateway processes can
serve one port (``sendpath gateway --workers N``): uvicorn imports ``app_from_env`` in each
worker, which reads the config from ``$SENDPATH_GATEWAY_CONFIG``; they share keys and the
usage ledger through SQLite and the rate limits through Redis (``--redis``).

Open to anyone: ``/health``, ``/fleet`` (what the page draws) and ``/metrics``
(``routes_fleet.py``). Everything under ``/v1/`` (``routes_api.py``) needs a key when keys
are required. What the app is made of is ``parts.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from sendpath.api.errors import (
    InternalErrorMiddleware,
    RequestIdMiddleware,
    install_error_handlers,
)
from sendpath.api.http_server import GuardedProtocol
from sendpath.api.openapi import publish_request_schemas
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.clock import Clock, RealClock
from sendpath.config import ConnectionLimits, GatewayConfig
from sendpath.gateway import routes_api, routes_fleet
from sendpath.gateway.input_filter import SafetyMiddleware
from sendpath.gateway.keys import KeyStore
from sendpath.gateway.limiting import RateLimitMiddleware
from sendpath.gateway.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyMiddleware,
    ForwardMiddleware,
    TraceMiddleware,
)
from sendpath.gateway.parts import FleetStatus, GatewayParts, Members, build_parts, key_store
from sendpath.gateway.ratelimit import RateLimiter
from sendpath.gateway.safety import SafetyCheck
from sendpath.telemetry.export import Tracing

__all__ = [
    "CONFIG_ENV",
    "GatewayApp",
    "app_from_env",
    "create_gateway_app",
    "ensure_first_key",
    "key_store",
    "settle_heap",
]

CONFIG_ENV = "SENDPATH_GATEWAY_CONFIG"
YOUNG_THRESHOLD = 10_000  # allocations past frees that start a young collection (``settle_heap``)


def ensure_first_key(store: KeyStore) -> str | None:
    """On a first start (no keys at all), create key 'default' and return its secret."""
    if not store.is_empty():
        return None
    _, secret = store.create("default")
    return secret


class GatewayApp(FastAPI):
    """FastAPI's app behind the gateway's own middleware stack (``stack``): every HTTP
    request goes through the stack first; a generation request is answered there (by
    ``ForwardMiddleware``), without FastAPI's per-request layers (its telemetry check, its
    error, body-limit and exception middleware, the routing), and everything else goes on
    to FastAPI (``routed``)."""

    stack: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.stack(scope, receive, send)
        else:  # lifespan
            await super().__call__(scope, receive, send)

    async def routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request as FastAPI serves it: its routes, error handlers and middleware."""
        await super().__call__(scope, receive, send)


def create_gateway_app(
    config: GatewayConfig,
    clock: Clock | None = None,
    limiter: RateLimiter | None = None,
    safety: SafetyCheck | None = None,
    fleet_status: FleetStatus | None = None,
    members: Members | None = None,
    tracing: Tracing | None = None,
) -> GatewayApp:
    """The gateway app; ``limiter``, ``safety``, ``members`` and ``tracing`` override what
    the config would build."""
    parts = build_parts(
        config, clock or RealClock(), limiter, safety, fleet_status, members, tracing
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if parts.members is not None:  # before any task: a cancelled start leaves none
            await parts.members.first()
        checks = asyncio.create_task(
            parts.router.run_checks(parts.client, config.health_interval_s)
        )
        following = None if parts.members is None else asyncio.create_task(parts.members.run())
        try:
            yield
        finally:
            checks.cancel()
            if following is not None:
                following.cancel()
            try:
                if parts.follower is not None:
                    await parts.follower.aclose()
                await parts.ledger.flush()
                await parts.proxy.aclose()
                await parts.client.aclose()
            finally:  # the spans waiting go out whatever failed above
                if parts.spans is not None:
                    parts.spans.close()
                if parts.tracing is not None:
                    await asyncio.to_thread(parts.tracing.shutdown)

    app = GatewayApp(title="sendpath gateway", lifespan=lifespan)
    app.state.parts = parts
    app.state.pool, app.state.queue, app.state.keys = parts.pool, parts.queue, parts.keys
    app.state.router = parts.router
    app.mount("/web", StaticFiles(directory=routes_fleet.WEB), name="web")
    install_error_handlers(app, config.retry_after_s)
    app.include_router(routes_fleet.router)
    app.include_router(routes_api.router)
    publish_request_schemas(
        app, {"/v1/chat/completions": ChatBody, "/v1/completions": CompletionBody}
    )
    app.stack = middleware_stack(app.routed, parts)
    return app


def middleware_stack(inner: ASGIApp, parts: GatewayParts) -> ASGIApp:
    """One pure-ASGI middleware per concern (``middleware.py``) around ``inner``, built
    from the inside out: the last one here runs first."""
    config = parts.config
    app: ASGIApp = ForwardMiddleware(inner, parts.proxy.forward, config.retry_after_s)
    app = AdmissionMiddleware(app, parts.queue, config.retry_after_s)
    if parts.safety is not None:
        app = SafetyMiddleware(app, parts.safety, parts.text.detokenize)
    app = RateLimitMiddleware(
        app,
        limiter=parts.limiter,
        keys=parts.keys,
        ledger=parts.ledger,
        default_max_tokens=config.default_max_tokens,
        count=parts.text.count,
    )
    app = BodyMiddleware(app, max_bytes=config.max_body_bytes)
    app = AuthMiddleware(
        app,
        keys=parts.keys,
        required=config.require_keys,
        per_key_salt=config.prefix_cache_isolation == "per-key",
        live=parts.live,
    )
    sampler = parts.tracing.sampler if parts.tracing is not None else None
    app = TraceMiddleware(app, parts.clock, parts.metrics.responded, parts.ended, sampler)
    app = RequestIdMiddleware(app)
    return InternalErrorMiddleware(app)


def settle_heap() -> None:
    """Set the cyclic collector up for serving, once the app is built (a request's objects
    are freed by their reference counts; the collector only finds cycles):

    - the objects alive now (modules, the app) leave its sight for good (``gc.freeze``),
      after one collection of what starting left, so its passes over the oldest
      generation no longer walk them, nor every request in flight promoted there. A
      frozen object that becomes garbage is still freed by its reference count; only a
      cycle among them would stay;
    - the youngest generation is collected after ``YOUNG_THRESHOLD`` more allocations
      than frees, not 700, which the objects of a few requests in flight cross over and
      over (each pass promoting what was in flight).

    What each cost before is measured in benchmarks/README.md (gateway_overhead.py)."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)


def config_to_env(config: GatewayConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def app_from_env() -> GatewayApp:
    """The app factory each ``--workers`` process imports: config from the environment."""
    raw: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    raw["replicas"] = tuple(raw["replicas"])
    raw["replica_keys"] = tuple(raw["replica_keys"])
    raw["connection"] = ConnectionLimits(**raw["connection"])
    config = GatewayConfig(**raw)
    GuardedProtocol.limits = config.connection  # this worker's connections
    app = create_gateway_app(config)
    settle_heap()
    return app
