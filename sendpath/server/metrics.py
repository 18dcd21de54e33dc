"""Prometheus metrics of one replica, named as vLLM's with a ``sendpath:`` prefix.

Latency histograms are observed once per finished request from its timeline; the engine's
gauges and counters (running, waiting, KV usage, prefix cache, preemptions) are read from
an engine statistics snapshot taken when ``/metrics`` is scraped.

The three gauges a load-aware balancer reads are also exported under vLLM's own names,
with its ``model_name`` label (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``), so the Gateway API Inference Extension's endpoint picker
and llm-d's scorers read a sendpath replica as they read a vLLM one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sendpath.engine.scheduler import SchedulerStats
from sendpath.engine.speculative import SpecStats
from sendpath.request import Request
from sendpath.telemetry.genai_metrics import GenAIMetrics
from sendpath.trace import Stage

__all__ = ["ReplicaMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.stats: SchedulerStats | None = None
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting for a slot.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_cache_usage),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"sendpath:{name}", doc, value)
        for name, doc, value in gauges:  # as vLLM names them, for balancers that read those
            vllm = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            vllm.add_metric([self.model_name], value)
            yield vllm
        yield CounterMetricFamily(
            "sendpath:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "sendpath:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            s.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            "sendpath:num_preemptions",
            "Requests preempted for want of KV blocks.",
            s.num_preemptions,
        )
        if s.spec is not None:
            yield from _spec_decode(s.spec)


def _spec_decode(spec: SpecStats) -> Iterator[Metric]:
    """Speculative decoding's counters, as vLLM names them."""
    for name, doc, value in (
        ("num_drafts", "Draft proposals verified.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens kept.", spec.num_accepted_tokens),
    ):
        yield CounterMetricFamily(f"sendpath:spec_decode_{name}", doc, value)
    per_pos = CounterMetricFamily(
        "sendpath:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens kept, by their position in the proposal (0: the first).",
        labels=["position"],
    )
    for position, value in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([str(position)], value)
    yield per_pos


class ReplicaMetrics:
    """A registry of its own (several apps can live in one process, as in tests)."""

    def __init__(self, model_name: str = "model") -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY) -> Histogram:
            return Histogram(f"sendpath:{name}", doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL)
        self.queue = hist("request_queue_time_seconds", "Time waiting in the engine queue.")
        self.prefill = hist("request_prefill_time_seconds", "Time in prefill.")
        self.decode = hist("request_decode_time_seconds", "First token to last token.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.prompt_tokens = Counter(
            "sendpath:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "sendpath:generation_tokens", "Generated tokens.", registry=r
        )
        self.ended = Counter(
            "sendpath:request_success",
            "Requests that ended, by why: stop, length, abort (the client left) or error.",
            ["finished_reason"],
            registry=r,
        )
        self.genai = GenAIMetrics(r)  # the GenAI conventions' server metrics
        self._engine = _EngineCollector(model_name)
        r.register(self._engine)
        self.engine_info = Info(
            "sendpath:engine",
            "What the engine runs on: device, weights, and the matrix engine its products use.",
            registry=r,
        )

    def describe_engine(self, runs: dict[str, Any]) -> None:
        """Set ``sendpath:engine_info`` from the runner's ``describe()`` (once loaded)."""
        keys = ("device", "dtype", "quantization", "matrix_engine", "attention")
        self.engine_info.info({k: str(runs[k]) for k in keys if k in runs})

    def observe(self, request: Request) -> None:
        """Record a finished (or aborted) request."""
        tl = request.timeline
        stages = tl.stages()
        if tl.ttft is not None:
            self.ttft.observe(tl.ttft)
        for gap in tl.itls:
            self.itl.observe(gap)
        self.queue.observe(stages.get(Stage.ENGINE_QUEUE, 0.0))
        if Stage.PREFILL in stages:
            self.prefill.observe(stages[Stage.PREFILL])
        if Stage.DECODE in stages:
            self.decode.observe(stages[Stage.DECODE])
        start, end = tl.events[0].time if tl.events else None, tl.end
        if start is not None and end is not None:
            self.e2e.observe(end - start)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(len(request.output_token_ids))

    def render(self, stats: SchedulerStats | None) -> bytes:
        """The text exposition, with the engine's numbers as of ``stats``."""
        self._engine.stats = stats
        return generate_latest(self.registry)
