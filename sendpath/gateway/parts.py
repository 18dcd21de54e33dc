"""The pieces one gateway app is made of, built from its config (``build_parts``).

The routes find them on ``request.app.state.parts`` (``parts_of``); the middleware stack
gets the ones it needs when the app is made (``app.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request

from sendpath.clock import Clock
from sendpath.config import GatewayConfig
from sendpath.gateway import spans
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.context import GatewayContext
from sendpath.gateway.keys import KeyStore, default_data_dir
from sendpath.gateway.kv_events import KVEventFollower
from sendpath.gateway.ledger import UsageLedger
from sendpath.gateway.metrics import GatewayMetrics
from sendpath.gateway.proxy import KEEPALIVE_S, Proxy, ProxyTimeouts
from sendpath.gateway.ratelimit import RateLimiter, make_limiter
from sendpath.gateway.safety import DEFAULT_RULES, OutputGuard, RulesFilter, SafetyCheck
from sendpath.gateway.spans import SpanExport, span_error
from sendpath.gateway.tokens import ReplicaText
from sendpath.gateway.tracing import GatewayTrace, record
from sendpath.gateway.upstream import UpstreamClient
from sendpath.router.kv_index import KVIndex
from sendpath.router.policy import make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.router.router import Router
from sendpath.telemetry.export import Tracing
from sendpath.trace import TraceStore

if TYPE_CHECKING:
    from sendpath.cluster.members import DirectoryFollower

__all__ = ["FleetStatus", "GatewayParts", "build_parts", "key_store", "parts_of"]

logger = logging.getLogger("sendpath.gateway")

# The processes behind the replicas, by URL, when `sendpath serve` started them
FleetStatus = Callable[[], dict[str, dict[str, Any]]]
# What keeps the pool equal to a cluster engine's replicas (``cluster/members.py``)
Members = Callable[[Router, AdmissionQueue], "DirectoryFollower"]


def key_store(config: GatewayConfig) -> KeyStore:
    return KeyStore(Path(config.data_dir) if config.data_dir else default_data_dir())


@dataclass
class GatewayParts:
    """Everything a gateway app shares between its requests."""

    config: GatewayConfig
    clock: Clock
    keys: KeyStore
    pool: ReplicaPool
    metrics: GatewayMetrics
    limiter: RateLimiter
    safety: SafetyCheck | None  # None: no input or output filter
    queue: AdmissionQueue
    router: Router
    proxy: Proxy
    ledger: UsageLedger  # finished requests' usage, written in batches
    text: ReplicaText  # counts and detokenizes with the replicas
    follower: KVEventFollower | None  # the replicas' KV events (None: approximate routing)
    # health checks and the operator's views (not per request): httpx
    client: httpx.AsyncClient
    fleet_status: FleetStatus | None
    members: DirectoryFollower | None  # a cluster engine's replicas (None: a fixed pool)
    tracing: Tracing | None  # where requests' spans go (None: tracing off)
    traces: TraceStore[GatewayTrace]  # finished requests', by answer id
    live: TraceStore[GatewayContext] = field(  # in flight, by key and client id
        default_factory=lambda: TraceStore(1024)
    )
    whatif_slot: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    spans: SpanExport | None = field(init=False)  # from ``tracing``

    def ended(self, ctx: GatewayContext, operation: str) -> None:
        """A generation request's response ended (answered or refused): the GenAI
        metrics, and its spans if tracing is on."""
        end = ctx.end if ctx.end is not None else self.clock.now()
        model = ctx.body.get("model") if ctx.body is not None and ctx.response_id else None
        self.metrics.genai.observe(
            operation,
            model if isinstance(model, str) else "",  # only an answered request's: a
            end - ctx.start,  # refused one could name anything
            span_error(ctx),
            _ttft(ctx),
            ctx.usage[1] if ctx.usage is not None else ctx.streamed_chunks,
        )
        if self.spans is None:
            return
        try:
            self.spans.ended(ctx, operation, end)
        except Exception:  # a trace is never worth a request
            logger.exception("request %s: its spans could not be exported", ctx.request_id)

    def __post_init__(self) -> None:
        self.spans = SpanExport(self.tracing, self.clock) if self.tracing is not None else None


def _ttft(ctx: GatewayContext) -> float | None:
    """Seconds from arrival here to the first token: sent on (a stream), or made at the
    replica (a whole answer: its arrival there plus its own time to the first token)."""
    if ctx.first_token_at is not None:
        return ctx.first_token_at - ctx.start
    ttft = ctx.replica_timings.get("ttft")
    if ttft is None or ctx.replica_arrival is None:
        return None
    return ctx.replica_arrival - ctx.start + ttft / 1000


def finished(
    metrics: GatewayMetrics, traces: TraceStore[GatewayTrace], ctx: GatewayContext
) -> None:
    """A request finished: its metrics, and its trace if it has an id."""
    stages, timings = ctx.final or (ctx.stage_seconds(), None)
    metrics.finished(ctx, stages)
    if ctx.response_id is not None:
        traces.put(ctx.response_id, record(ctx, stages, timings))


def build_parts(
    config: GatewayConfig,
    clock: Clock,
    limiter: RateLimiter | None,
    safety: SafetyCheck | None,
    fleet_status: FleetStatus | None,
    members: Members | None = None,
    tracing: Tracing | None = None,
) -> GatewayParts:
    """The parts for ``config``; ``limiter``, ``safety``, ``members`` and ``tracing``
    override what it would build (``members``: what follows a cluster's replicas; by
    default the Ray cluster at ``config.ray_address``, if any)."""
    keys = key_store(config)
    if members is None and config.ray_address is not None:
        from sendpath.cluster.members import ray_members

        members = ray_members(config.ray_address, config.replica_api_key)
    pool = ReplicaPool(
        config.replicas,
        config.max_inflight_per_replica,
        clock,
        config.keys_by_replica(),
        dynamic=members is not None,
    )
    metrics = GatewayMetrics(pool)
    limiter = limiter or make_limiter(
        config.redis_url, config.redis_fail_open, metrics.store_errors.inc
    )
    if safety is None and config.safety:
        safety = RulesFilter.from_toml(Path(config.safety_rules or DEFAULT_RULES))
    queue = AdmissionQueue(pool.capacity, config.max_queued_requests, config.queue_timeout_s)
    precise = config.policy == "prefix_aware" and config.prefix_routing == "precise"
    index = KVIndex(clock) if precise else None
    follower = KVEventFollower(index) if index is not None else None
    router = Router(
        pool,
        make_policy(config.policy, index),
        lambda: queue.resize(pool.capacity),
        follower.sync if follower is not None else lambda pool: None,
    )
    timeouts = ProxyTimeouts(
        connect_s=config.connect_timeout_s,
        first_token_s=config.first_token_timeout_s,
        between_tokens_s=config.between_tokens_timeout_s,
        whole_answer_s=config.upstream_timeout_s,
        retry_deadline_s=config.retry_deadline_s,
    )
    checker = safety
    guard = (lambda: OutputGuard(checker)) if checker is not None else None
    client = UpstreamClient(timeouts.connect_s, KEEPALIVE_S)
    text = ReplicaText(pool, client)
    traces: TraceStore[GatewayTrace] = TraceStore()
    done = functools.partial(finished, metrics, traces)
    proxy = Proxy(router, client, guard, timeouts, done, text.tokens if precise else None)
    return GatewayParts(
        config=config,
        clock=clock,
        keys=keys,
        pool=pool,
        metrics=metrics,
        limiter=limiter,
        safety=safety,
        queue=queue,
        router=router,
        proxy=proxy,
        ledger=UsageLedger(keys),
        text=text,
        follower=follower,
        client=httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=config.connect_timeout_s)),
        fleet_status=fleet_status,
        members=members(router, queue) if members is not None else None,
        traces=traces,
        tracing=tracing or _tracing(config),
    )


def _tracing(config: GatewayConfig) -> Tracing | None:
    """Span export as the config and the environment say (``None``: off); where spans go
    out as bytes, built in C where it builds (the process logs which)."""
    tracing = Tracing.configured(config.otlp_traces_endpoint, "sendpath-gateway")
    if tracing is not None and tracing.encoded:
        logger.info("gateway spans built %s", spans.prefer_native())
    return tracing


def parts_of(request: Request) -> GatewayParts:
    """The parts of the app serving ``request``."""
    parts: GatewayParts = request.app.state.parts
    return parts
