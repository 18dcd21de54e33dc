"""A replica's state behind its HTTP app: the engine (loaded in the background), whether
it takes requests (``status``: loading, ok, draining, stuck, failed), its metrics and
traces, and the watch that ends the process when the engine stops or gets stuck."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sendpath.config import ReplicaConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore
from sendpath.errors import ServiceUnavailableError
from sendpath.kvcache.native import HOW as KV_NATIVE
from sendpath.request import Request as EngineRequest
from sendpath.server.kv_events import KVEventPublisher
from sendpath.server.metrics import ReplicaMetrics
from sendpath.server.protocol import ParsedRequest
from sendpath.server.responses import timings_ms
from sendpath.server.spans import OPERATIONS, extent, replica_span
from sendpath.telemetry.export import Tracing
from sendpath.telemetry.trace_context import TraceParent
from sendpath.trace import TraceStore, event_log

__all__ = ["Replica", "served_name"]

logger = logging.getLogger("sendpath.replica")

WATCH_INTERVAL_S = 0.5
SERVICE = "sendpath-replica"  # its spans' service.name, unless OTEL_SERVICE_NAME says
PRECISION = (  # what /load says the engine computes in
    "dtype",
    "quantization",
    "precision_reason",
    "matrix_engine",
    "attention",
    "kv_cache_dtype",
)


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

    def __init__(
        self,
        config: ReplicaConfig,
        engine: AsyncEngine | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        # where requests' spans go (None: tracing off)
        self.tracing = tracing or Tracing.configured(config.otlp_traces_endpoint, SERVICE)
        self.model_name = served_name(config)
        self.engine = engine
        self.kv_events: KVEventPublisher | None = None  # publishing its cache's events
        self.draining = False
        self.load_error: BaseException | None = None
        self.metrics = ReplicaMetrics(self.model_name)
        if engine is not None:  # handed in loaded (tests, the simulator's profile)
            self.metrics.describe_engine(self.runs_on())
        self.traces: TraceStore[dict[str, Any]] = TraceStore()
        self.active: TraceStore[EngineRequest] = TraceStore()  # in flight, by response id

    def finished(self, response_id: str, request: EngineRequest, reason: str) -> None:
        """Record a finished request: metrics, and its trace for ``/v1/traces/{id}``."""
        self.metrics.observe(request)
        self.metrics.ended.labels(reason).inc()
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

    def answered(
        self,
        parsed: ParsedRequest,
        requests: list[EngineRequest],
        response_id: str,
        reasons: list[str],
        traceparent: str | None,
    ) -> None:
        """An answered request (its ``n`` engine requests): the GenAI metrics, and its
        spans (``server/spans.py``) in the trace its ``traceparent`` names, else in a
        trace of their own, if tracing is on."""
        lasted = extent(requests)
        if lasted is not None:
            self.metrics.genai.observe(
                OPERATIONS[parsed.kind],
                parsed.model,
                lasted[1] - lasted[0],
                ttft=requests[0].timeline.ttft,
                output_tokens=len(requests[0].output_token_ids),
            )
        if self.tracing is None or self.engine is None:
            return
        try:
            parent = TraceParent.parse(traceparent)
            context = self.tracing.sampler.start(parent)
            span = replica_span(parsed, requests, response_id, reasons) if context.sampled else None
            if span is None:
                return
            parent_id = parent.span_id if parent is not None else None
            self.tracing.emit(span, context, parent_id, self.engine.core.clock)
        except Exception:  # a trace is never worth a request
            logger.exception("request %s: its spans could not be exported", response_id)

    @property
    def status(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        if not self.engine.is_running:
            return "failed"
        return "stuck" if self.engine.step_seconds() > self.config.stuck_step_s else "ok"

    async def load(self) -> None:
        config = self.config.engine
        try:  # the model is made on the engine's own thread, where it will run
            publisher = self._open_events()  # first: a taken port fails before the model
            engine = await asyncio.to_thread(
                AsyncEngine.build, lambda: self._built(EngineCore.from_config(config), publisher)
            )
        except BaseException as exc:
            self.load_error = exc
            logger.error("the model could not be loaded, /health says 'failed': %s", exc)
            return
        self.engine = engine
        runs = self.runs_on()
        self.metrics.describe_engine(runs)
        logger.info(
            "%s loaded: %s, %s weights, quantization %s (%s); matrix engine: %s; attention: %s; "
            "KV cache: %s; layer ops: %s; prefix cache's block hashes and pool %s",
            self.model_name,
            runs.get("device"),
            runs.get("dtype"),
            runs.get("quantization"),
            runs.get("precision_reason"),
            runs.get("matrix_engine"),
            runs.get("attention"),
            runs.get("kv_cache_dtype"),
            runs.get("layer_ops"),
            KV_NATIVE,
        )
        if (spec := config.speculative) is not None:
            logger.info(
                "speculative decoding: %s, up to %d draft tokens a step (n-grams of %d-%d), "
                "off in steps with more than %d decodes",
                spec.method,
                spec.num_speculative_tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
                spec.disable_by_batch_size,
            )

    def _open_events(self) -> KVEventPublisher | None:
        """The publisher ``--kv-events-config`` asks for (``None``: it asks for none)."""
        events = self.config.kv_events
        if not events.publishes:
            return None
        from sendpath.model.loader import resolve_device  # the engine's own rule

        on_gpu = resolve_device(self.config.engine.device).type == "cuda"
        self.kv_events = KVEventPublisher(events, "GPU" if on_gpu else "CPU")
        logger.info(
            "KV events: publishing on %s (replay: %s, topic %r)",
            self.kv_events.endpoint,
            self.kv_events.replay_endpoint,
            events.topic,
        )
        return self.kv_events

    @staticmethod
    def _built(core: EngineCore, publisher: KVEventPublisher | None) -> EngineCore:
        """``core``, handing its prefix-cache events to ``publisher`` (its thread)."""
        if publisher is not None:
            core.publish_kv_events(publisher.publish)
        return core

    async def start_events(self) -> None:
        """Publish a handed-in engine's events (before it serves: its cache is taken as
        empty, ``EngineCore.publish_kv_events``)."""
        if self.engine is not None and (publisher := self._open_events()) is not None:
            await asyncio.wrap_future(self.engine.call(lambda core: self._built(core, publisher)))

    def stop_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()

    def events_endpoints(self) -> dict[str, Any] | None:
        """Where gateways subscribe to this replica's events (``/load``); ``None`` when it
        publishes none, or connects to its subscriber instead."""
        publisher = self.kv_events
        if publisher is None or not publisher.bound or self.engine is None:
            return None
        return {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "topic": publisher.config.topic,
            "block_size": self.engine.core.scheduler.kv.block_size,
        }

    def runs_on(self) -> dict[str, Any]:
        """What the engine runs on and in (the model runner's ``describe()``)."""
        describe = getattr(self.engine.core.runner, "describe", None) if self.engine else None
        found: dict[str, Any] = describe() if describe is not None else {}
        return found

    def load_report(self) -> dict[str, Any]:
        """What ``/load`` says: running, waiting and KV usage as of the engine's last step,
        its precision and where it publishes KV events (raises while it is not ready)."""
        stats = self.ready_engine().snapshot
        runs = self.runs_on()
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "precision": {k: runs.get(k) for k in PRECISION},
            "kv_events": self.events_endpoints(),
            "kv_events_sent": self.kv_events.sent if self.kv_events is not None else 0,
        }

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None or self.status != "ok":
            raise ServiceUnavailableError(f"The server is {self.status}; retry in a moment.")
        return self.engine

    async def watch(self, on_failure: Callable[[], None]) -> None:
        """Call ``on_failure`` once if the engine stops, or gets stuck, while serving."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            engine, status = self.engine, self.status
            if engine is None or self.draining or status not in ("failed", "stuck"):
                continue
            if status == "failed":
                logger.error("the engine stopped (%s): this replica exits", engine.error)
            else:
                logger.error(
                    "an engine step has run for %.0f s (over %g s): the engine is stuck and "
                    "this replica exits",
                    engine.step_seconds(),
                    self.config.stuck_step_s,
                )
            on_failure()
            return
