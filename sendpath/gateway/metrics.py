"""The gateway's Prometheus metrics: where requests spend their time, stage by stage, and
how each replica is doing (health, in flight, load), read from the pool at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sendpath.gateway.context import GatewayContext
from sendpath.router.pool import ReplicaPool
from sendpath.telemetry.genai_metrics import GenAIMetrics
from sendpath.trace import Stage

__all__ = ["GatewayMetrics"]

_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0,
)  # fmt: skip


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "sendpath:replica_healthy", "1 if the replica is in service.", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "sendpath:replica_in_flight",
            "This gateway's requests at the replica.",
            labels=["replica"],
        )
        load = GaugeMetricFamily(
            "sendpath:replica_load",
            "Requests the replica is busy with (this gateway's plus those it reported).",
            labels=["replica"],
        )
        for e in self.pool.endpoints:
            healthy.add_metric([e.url], 1.0 if e.healthy else 0.0)
            in_flight.add_metric([e.url], e.in_flight)
            load.add_metric([e.url], e.load)
        yield from (healthy, in_flight, load)


class GatewayMetrics:
    """A registry of its own per gateway app."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.registry = CollectorRegistry()
        self.stage = Histogram(
            "sendpath:stage_seconds",
            "Seconds each finished request spent in each stage of its path.",
            ["stage"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sendpath:gateway_request_seconds",
            "Arrival at the gateway to the last byte of the answer.",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.responses = Counter(
            "sendpath:gateway_responses",
            "Responses by HTTP status code.",
            ["code"],
            registry=self.registry,
        )
        self.store_errors = Counter(
            "sendpath:gateway_store_errors",
            "Calls to the shared rate-limit store (Redis) that failed.",
            registry=self.registry,
        )
        self.genai = GenAIMetrics(self.registry)  # the GenAI conventions' server metrics
        self.registry.register(_PoolCollector(pool))
        self._by_stage: dict[Stage, Histogram] = {}  # each label's child, looked up once
        self._by_code: dict[int, Counter] = {}

    def finished(self, ctx: GatewayContext, stages: list[tuple[Stage, float, float]]) -> None:
        """A finished request's stages (``ctx.stage_seconds()``) and its whole time."""
        for stage, _, seconds in stages:
            child = self._by_stage.get(stage)
            if child is None:
                child = self._by_stage[stage] = self.stage.labels(stage.value)
            child.observe(seconds)
        if ctx.end is not None:
            self.e2e.observe(ctx.end - ctx.start)

    def responded(self, code: int) -> None:
        """A response went out with this status code."""
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self.responses.labels(code)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
