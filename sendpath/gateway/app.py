"""The gateway's HTTP app: the middleware stack in front of the replica pool.

``create_gateway_app`` builds it from a ``GatewayConfig``. Several gateway processes can
serve one port (``sendpath gateway --workers N``): uvicorn imports ``app_from_env`` in each
worker, which reads the config from ``$SENDPATH_GATEWAY_CONFIG``; they share keys and the
usage ledger through SQLite and the rate limits through Redis (``--redis``).

Open to anyone: ``/health``, ``/fleet`` (what the page draws) and ``/metrics`` (operator
views: they name replica URLs; nothing sent to a client about its own request does).
Everything under ``/v1/`` needs a key when keys are required.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from sendpath.api.errors import RequestIdMiddleware, install_error_handlers
from sendpath.api.http_server import GuardedProtocol
from sendpath.api.openapi import publish_request_schemas
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.clock import Clock, RealClock
from sendpath.config import ConnectionLimits, GatewayConfig
from sendpath.errors import ServiceUnavailableError, TraceNotFoundError
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.input_filter import SafetyMiddleware
from sendpath.gateway.keys import ApiKey, KeyStore, default_data_dir
from sendpath.gateway.ledger import UsageLedger
from sendpath.gateway.limiting import RateLimitMiddleware
from sendpath.gateway.metrics import GatewayMetrics
from sendpath.gateway.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyMiddleware,
    ForwardMiddleware,
    TraceMiddleware,
    live_key,
)
from sendpath.gateway.proxy import Proxy, ProxyTimeouts
from sendpath.gateway.ratelimit import RateLimiter, make_limiter
from sendpath.gateway.safety import DEFAULT_RULES, OutputGuard, RulesFilter, SafetyCheck
from sendpath.gateway.tokens import ReplicaText
from sendpath.gateway.tracing import GatewayTrace, progress_of, record, stitch
from sendpath.router.policy import make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.router.router import Router
from sendpath.trace import TraceStore

__all__ = ["CONFIG_ENV", "app_from_env", "create_gateway_app", "ensure_first_key"]

CONFIG_ENV = "SENDPATH_GATEWAY_CONFIG"
WEB = Path(__file__).parent.parent / "web"  # the page: plain HTML, CSS and JavaScript
WHATIF_WAIT_S = 10.0  # a what-if waits this long for the one running before it, then 503

# The processes behind the replicas, by URL, when `sendpath serve` started them
FleetStatus = Callable[[], dict[str, dict[str, Any]]]


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
    fleet_status: FleetStatus | None = None,
) -> FastAPI:
    """The gateway app; ``limiter`` and ``safety`` override what the config would build."""
    clock = clock or RealClock()
    keys = key_store(config)
    pool = ReplicaPool(
        config.replicas, config.max_inflight_per_replica, clock, config.keys_by_replica()
    )
    metrics = GatewayMetrics(pool)
    limiter = limiter or make_limiter(
        config.redis_url, config.redis_fail_open, metrics.store_errors.inc
    )
    if safety is None and config.safety:
        safety = RulesFilter.from_toml(Path(config.safety_rules or DEFAULT_RULES))
    queue = AdmissionQueue(pool.capacity, config.max_queued_requests, config.queue_timeout_s)
    router = Router(pool, make_policy(config.policy), lambda: queue.resize(pool.capacity))
    traces: TraceStore[GatewayTrace] = TraceStore()
    live: TraceStore[GatewayContext] = TraceStore(1024)  # in flight, by key and client id
    whatif_slot = asyncio.Semaphore(1)

    def done(ctx: GatewayContext) -> None:
        metrics.finished(ctx)
        if ctx.response_id is not None:
            traces.put(ctx.response_id, record(ctx))

    checker = safety
    timeouts = ProxyTimeouts(
        connect_s=config.connect_timeout_s,
        first_token_s=config.first_token_timeout_s,
        between_tokens_s=config.between_tokens_timeout_s,
        whole_answer_s=config.upstream_timeout_s,
        retry_deadline_s=config.retry_deadline_s,
    )
    proxy = Proxy(
        router, (lambda: OutputGuard(checker)) if checker is not None else None, timeouts, done
    )
    ledger = UsageLedger(keys)  # finished requests' usage, written in batches
    text = ReplicaText(pool, proxy.session)  # counts and detokenizes with the replicas
    # health checks and the operator's views (not per request): httpx
    client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=config.connect_timeout_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checks = asyncio.create_task(router.run_checks(client, config.health_interval_s))
        try:
            yield
        finally:
            checks.cancel()
            await ledger.flush()
            await proxy.aclose()
            await client.aclose()

    app = FastAPI(title="sendpath gateway", lifespan=lifespan)
    app.state.pool, app.state.queue, app.state.keys = pool, queue, keys
    app.state.router = router
    app.mount("/web", StaticFiles(directory=WEB), name="web")
    install_error_handlers(app, config.retry_after_s)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = sum(e.healthy for e in pool.endpoints)
        status = "ok" if healthy else "unavailable"
        replicas = [
            {
                "name": e.name,
                "url": e.url,
                "healthy": e.healthy,
                "in_flight": e.in_flight,
                "load": e.load,
            }
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
        """The gateway's queue and each replica's health, load and process, for the page."""
        processes = fleet_status() if fleet_status is not None else {}
        replicas = []
        for e in pool.endpoints:
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
                    **processes.get(e.url, {}),
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
        endpoint = pool.by_url(found.replica_url) if found.replica_url else None
        if endpoint is not None:
            try:
                r = await client.get(
                    f"{endpoint.url}/v1/traces/{response_id}", headers=endpoint.headers
                )
                replica_trace = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                replica_trace = None
        return JSONResponse(stitch(found, replica_trace))

    @app.get("/v1/progress/{client_id}")
    async def progress(client_id: str, request: Request) -> dict[str, Any]:
        """The stage an in-flight request is in now (for the page's live pipeline)."""
        found = live.get(live_key(_key_name(context(request.scope).key), client_id))
        if found is None:
            raise TraceNotFoundError(client_id)
        endpoint = pool.by_url(found.replica) if found.replica else None
        headers = endpoint.headers if endpoint is not None else {}
        return await progress_of(found, client_id, client, headers)

    @app.get("/v1/whatif")
    async def whatif(
        rate: float = 1.0, prompt: int = 256, answer: int = 256, replicas: int = 1
    ) -> dict[str, Any]:
        """The page's "what if": the simulator's stage shares for this traffic (Llama-3.1-8B
        on H100s). Bounded work, one at a time per gateway process, off the event loop."""
        from sendpath.sim.whatif import what_if

        try:
            async with asyncio.timeout(WHATIF_WAIT_S):
                await whatif_slot.acquire()
        except TimeoutError:
            raise ServiceUnavailableError(
                "Another what-if simulation is running; retry in a moment."
            ) from None
        try:
            return await asyncio.to_thread(what_if, rate, prompt, answer, replicas)
        finally:
            whatif_slot.release()

    @app.get("/v1/models")
    async def models() -> Response:
        """The model list of the first healthy replica that answers."""
        for endpoint in pool.candidates():
            try:
                upstream = await client.get(
                    endpoint.url + "/v1/models", headers=endpoint.headers, timeout=5.0
                )
            except httpx.HTTPError as exc:
                router.failed(endpoint, f"{type(exc).__name__} on /v1/models")
                continue
            if upstream.status_code == 200:
                return Response(upstream.content, 200, media_type="application/json")
        raise ServiceUnavailableError("No healthy replica to ask; retry in a moment.")

    # ForwardMiddleware answers these two first; the routes publish their schema
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.forward(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request)

    publish_request_schemas(
        app, {"/v1/chat/completions": ChatBody, "/v1/completions": CompletionBody}
    )
    # add_middleware wraps: the last added runs first.
    app.add_middleware(ForwardMiddleware, forward=proxy.forward, retry_after_s=config.retry_after_s)
    app.add_middleware(AdmissionMiddleware, queue=queue, retry_after_s=config.retry_after_s)
    if safety is not None:
        app.add_middleware(SafetyMiddleware, check=safety, detokenize=text.detokenize)
    app.add_middleware(
        RateLimitMiddleware,
        limiter=limiter,
        keys=keys,
        ledger=ledger,
        default_max_tokens=config.default_max_tokens,
        count=text.count,
    )
    app.add_middleware(BodyMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(
        AuthMiddleware,
        keys=keys,
        required=config.require_keys,
        per_key_salt=config.prefix_cache_isolation == "per-key",
        live=live,
    )
    app.add_middleware(
        TraceMiddleware, clock=clock, on_status=lambda code: metrics.responses.labels(code).inc()
    )
    app.add_middleware(RequestIdMiddleware)
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
    raw["replica_keys"] = tuple(raw["replica_keys"])
    raw["connection"] = ConnectionLimits(**raw["connection"])
    config = GatewayConfig(**raw)
    GuardedProtocol.limits = config.connection  # this worker's connections
    return create_gateway_app(config)
