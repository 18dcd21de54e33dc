"""The gateway's HTTP app: the middleware stack in front of the replica pool.

``create_gateway_app`` builds it from a ``GatewayConfig``. Several gateway processes can
serve one port (``sendpath gateway --workers N``): uvicorn imports ``app_from_env`` in each
worker, which reads the config from ``$SENDPATH_GATEWAY_CONFIG``; they share keys and the
usage ledger through SQLite and the rate limits through Redis (``--redis``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from sendpath.clock import Clock, RealClock
from sendpath.config import GatewayConfig
from sendpath.errors import SendpathError, ServiceUnavailableError, TraceNotFoundError
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.keys import ApiKey, KeyStore, default_data_dir
from sendpath.gateway.metrics import GatewayMetrics
from sendpath.gateway.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyMiddleware,
    RateLimitMiddleware,
    SafetyMiddleware,
    TraceMiddleware,
)
from sendpath.gateway.proxy import Proxy
from sendpath.gateway.ratelimit import RateLimiter, make_limiter
from sendpath.gateway.safety import DEFAULT_RULES, OutputGuard, RulesFilter, SafetyCheck
from sendpath.gateway.tracing import GatewayTrace, record, stitch
from sendpath.router.policy import RouteRequest, make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.router.router import Router
from sendpath.server.responses import error_body
from sendpath.trace import Stage, TraceStore

__all__ = ["CONFIG_ENV", "app_from_env", "create_gateway_app", "ensure_first_key"]

CONFIG_ENV = "SENDPATH_GATEWAY_CONFIG"
WEB = Path(__file__).parent.parent / "web"  # the page: plain HTML, CSS and JavaScript


def key_store(config: GatewayConfig) -> KeyStore:
    return KeyStore(Path(config.data_dir) if config.data_dir else default_data_dir())


def ensure_first_key(store: KeyStore) -> str | None:
    """On a first start (no keys at all), create key 'default' and return its secret."""
    if not store.is_empty():
        return None
    _, secret = store.create("default")
    return secret


def create_gateway_app(
    config: GatewayConfig,
    clock: Clock | None = None,
    limiter: RateLimiter | None = None,
    safety: SafetyCheck | None = None,
) -> FastAPI:
    """The gateway app; ``limiter`` and ``safety`` override what the config would build."""
    clock = clock or RealClock()
    keys = key_store(config)
    limiter = limiter or make_limiter(config.redis_url)
    if safety is None and config.safety:
        safety = RulesFilter.from_toml(Path(config.safety_rules or DEFAULT_RULES))
    pool = ReplicaPool(config.replicas, config.max_inflight_per_replica, clock)
    queue = AdmissionQueue(pool.capacity, config.max_queued_requests, config.queue_timeout_s)
    router = Router(pool, make_policy(config.policy), lambda: queue.resize(pool.capacity))
    metrics = GatewayMetrics(pool)
    traces: TraceStore[GatewayTrace] = TraceStore()
    live: TraceStore[GatewayContext] = TraceStore(1024)  # in flight, by client id

    def done(ctx: GatewayContext) -> None:
        metrics.finished(ctx)
        if ctx.response_id is not None:
            traces.put(ctx.response_id, record(ctx))

    checker = safety
    proxy = Proxy(
        router,
        (lambda: OutputGuard(checker)) if checker is not None else None,
        config.upstream_timeout_s,
        config.retry_deadline_s,
        done,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checks = asyncio.create_task(router.run_checks(proxy.client, config.health_interval_s))
        yield
        checks.cancel()
        await proxy.aclose()

    app = FastAPI(title="sendpath gateway", lifespan=lifespan)
    app.state.pool, app.state.queue, app.state.keys = pool, queue, keys
    app.state.router = router
    app.mount("/web", StaticFiles(directory=WEB), name="web")

    @app.exception_handler(SendpathError)
    async def sendpath_error(request: Request, exc: SendpathError) -> JSONResponse:
        headers = {"Retry-After": str(config.retry_after_s)} if exc.status_code == 503 else None
        return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = sum(e.healthy for e in pool.endpoints)
        status = "ok" if healthy else "unavailable"
        replicas = [
            {"url": e.url, "healthy": e.healthy, "in_flight": e.in_flight, "load": e.load}
            for e in pool.endpoints
        ]
        return JSONResponse(
            {
                "status": status,
                "healthy": healthy,
                "policy": router.policy.name,
                "in_flight": queue.num_in_flight,
                "waiting": queue.num_waiting,
                "replicas": replicas,
            },
            status_code=200 if healthy else 503,
        )

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB / "index.html")

    @app.get("/fleet")
    async def fleet() -> dict[str, Any]:
        """The gateway's queue and each replica's health and load, for the page."""
        replicas = []
        for e in pool.endpoints:
            s = e.stats
            queries = s.get("prefix_cache_queries", 0.0)
            replicas.append(
                {
                    "url": e.url,
                    "healthy": e.healthy,
                    "in_flight": e.in_flight,
                    "running": int(s["num_requests_running"]) if s else None,
                    "waiting": int(s["num_requests_waiting"]) if s else None,
                    "kv_cache_usage": s.get("kv_cache_usage"),
                    "prefix_cache_hit_rate": (
                        s.get("prefix_cache_hits", 0.0) / queries if queries else None
                    ),
                }
            )
        return {
            "gateway": {
                "in_flight": queue.num_in_flight,
                "waiting": queue.num_waiting,
                "capacity": queue.capacity,
                "policy": router.policy.name,
            },
            "replicas": replicas,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/traces/{response_id}")
    async def trace(response_id: str, request: Request) -> JSONResponse:
        found = traces.get(response_id)
        if found is None or found.key != _key_name(context(request.scope).key):
            raise TraceNotFoundError(response_id)  # another key's trace does not exist
        replica_trace = None
        if found.replica is not None:
            try:
                r = await proxy.client.get(f"{found.replica}/v1/traces/{response_id}")
                replica_trace = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                replica_trace = None
        return JSONResponse(stitch(found, replica_trace))

    @app.get("/v1/progress/{client_id}")
    async def progress(client_id: str, request: Request) -> dict[str, Any]:
        """The stage an in-flight request is in now (for the page's live pipeline)."""
        found = live.get(client_id)
        if found is None or _key_name(found.key) != _key_name(context(request.scope).key):
            raise TraceNotFoundError(client_id)
        out: dict[str, Any] = {"client_id": client_id, "stage": found.gateway_stage().value}
        if found.first_token_at is not None:
            out["stage"] = Stage.DECODE.value
        elif found.replica is not None and found.replica_request_id is not None:
            out["stage"] = Stage.TOKENIZE.value
            try:
                r = await proxy.client.get(
                    f"{found.replica}/v1/requests/{found.replica_request_id}", timeout=1.0
                )
                engine = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                engine = None
            if engine is not None:
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

    @app.get("/v1/whatif")
    async def whatif(
        rate: float = 1.0, prompt: int = 256, answer: int = 256, replicas: int = 1
    ) -> dict[str, Any]:
        """The page's "what if": the simulator's stage shares for this traffic (Llama-3.1-8B
        on H100s), at most 200 requests so it answers within a few seconds."""
        from sendpath.sim.whatif import what_if

        return await asyncio.to_thread(what_if, rate, prompt, answer, replicas)

    @app.get("/v1/models")
    async def models() -> Response:
        endpoint = router.choose(RouteRequest(""))
        if endpoint is None:
            raise ServiceUnavailableError("No healthy replica to ask; retry in a moment.")
        upstream = await proxy.client.get(endpoint.url + "/v1/models")
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.forward(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request)

    # add_middleware wraps: the last added runs first.
    app.add_middleware(AdmissionMiddleware, queue=queue, retry_after_s=config.retry_after_s)
    if safety is not None:
        app.add_middleware(SafetyMiddleware, check=safety)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        keys=keys,
        default_reserve=config.default_reserve_tokens,
    )
    app.add_middleware(BodyMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(
        AuthMiddleware,
        keys=keys,
        required=config.require_keys,
        per_key_salt=config.prefix_cache_isolation == "per-key",
    )
    app.add_middleware(
        TraceMiddleware,
        clock=clock,
        on_status=lambda code: metrics.responses.labels(code).inc(),
        live=live,
    )
    return app


def _key_name(key: ApiKey | None) -> str | None:
    """Whose request it is: a trace or a progress report is only shown to its key."""
    return key.name if key else None


def config_to_env(config: GatewayConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def app_from_env() -> FastAPI:
    """The app factory each ``--workers`` process imports: config from the environment."""
    raw: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    raw["replicas"] = tuple(raw["replicas"])
    return create_gateway_app(GatewayConfig(**raw))
