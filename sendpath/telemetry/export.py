"""Sending ``SpanRecord`` trees to an OpenTelemetry collector over OTLP/HTTP (protobuf).

Off unless ``--otlp-traces-endpoint`` is given or the standard environment names an
endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``, to
which the exporter adds ``/v1/traces``); ``OTEL_SDK_DISABLED=true`` turns it off whatever
is given. The exporter reads the rest of the standard variables itself
(``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``, certificates), and the
resource takes ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.

A finished request's spans (a ``SpanRecord`` tree, with the times the request's event
list already holds: no span is started live, so there is no second clock and nothing to
end on every path) are encoded to OTLP protobuf there and then (``otlp.py``, in C where
it builds, which the process logs: a few microseconds a request, and bytes, not objects,
wait in the queue; the gateway builds and encodes its spans in one C call,
``gateway/spans.py``) and appended to a ``SpanQueue`` (``batching.py``: bounded, past
``MAX_QUEUE`` requests it drops, never blocks), whose thread sends them in batches of
``EXPORT_BATCH`` requests over the SDK's OTLP/HTTP exporter's client, so a collector
that refuses or hangs costs a request nothing. ``OTEL_BSP_MAX_QUEUE_SIZE``,
``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` and ``OTEL_BSP_SCHEDULE_DELAY`` set these as they do
for the SDK's batch processor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sendpath import __version__
from sendpath.clock import Clock
from sendpath.extras import require
from sendpath.telemetry.batching import SpanQueue
from sendpath.telemetry.otlp import (
    SpanTree,
    encode_request,
    encode_resource,
    encode_tree,
    prefer_native,
)
from sendpath.telemetry.sampling import Sampler
from sendpath.telemetry.spans import AttributeValue, SpanRecord
from sendpath.telemetry.trace_context import TraceParent, new_span_id

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["EXPORT_BATCH", "MAX_QUEUE", "Tracing", "traces_endpoint"]

MAX_QUEUE = 4096  # requests' spans waiting for export; more are dropped
# requests' spans a post (~1.3 kB a request: ~3 MB a post): a post's own cost is near a
# millisecond of the process's CPU, so the export thread takes ~3 us a request at 2048
# and ~8 us at the SDK's 512 (measured on loopback)
EXPORT_BATCH = 2048
SHUTDOWN_S = 3.0  # at exit, how long the last spans may take to go out

logger = logging.getLogger("sendpath.telemetry")


def traces_endpoint(flag: str | None) -> str | None:
    """The collector URL the flag gives (a bare ``http://host:port`` gets ``/v1/traces``),
    checked; ``None`` when the flag is not given. ValueError for a URL that is not one."""
    if flag is None:
        return None
    parts = urlsplit(flag)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-traces-endpoint takes an http(s) URL such as "
            f"http://127.0.0.1:4318/v1/traces; got {flag!r}"
        )
    return flag if parts.path not in ("", "/") else flag.rstrip("/") + "/v1/traces"


def _enabled(endpoint: str | None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return endpoint is not None or any(
        os.environ.get(name)
        for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )


class Tracing:
    """Where one process's spans go: its resource (service name), and either a queue of
    encoded spans (``queue``: what ``configured`` makes) or an SDK span processor fed
    ``SpanTree`` records (``processor``: any SDK exporter, the tests' in-memory one)."""

    def __init__(
        self,
        resource: Resource,
        processor: SpanProcessor | None = None,
        sampler: Sampler | None = None,
        queue: SpanQueue | None = None,
    ) -> None:
        if (processor is None) == (queue is None):
            raise ValueError("a Tracing sends through a processor or a queue, one of them")
        self.resource, self.processor, self.queue = resource, processor, queue
        self.sampler = sampler or Sampler.from_env()

    @property
    def encoded(self) -> bool:
        """Spans go out as bytes (``emit_encoded``), not records."""
        return self.queue is not None

    @classmethod
    def configured(cls, endpoint: str | None, service: str) -> Tracing | None:
        """Export to ``endpoint`` (from ``traces_endpoint``) or where the environment
        says; ``None`` when tracing is off (module docstring). Needs the ``otel`` extra."""
        if not _enabled(endpoint):
            return None
        if _protocol() != "http/protobuf":
            raise ValueError(
                f"OTLP protocol {_protocol()!r} is not supported: sendpath exports "
                "http/protobuf (unset OTEL_EXPORTER_OTLP_PROTOCOL, or set it to http/protobuf)"
            )
        require("otel")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = _resource(service)
        otlp = OTLPSpanExporter(endpoint=endpoint)  # endpoint None: the environment's
        client = getattr(otlp, "_client", None)
        if client is None or not hasattr(client, "export"):
            # not there (another SDK version): trees go through the exporter's own export
            # as ReadableSpan records, from the SDK's batch processor (slower, the same spans)
            batching = _batching()
            processor = BatchSpanProcessor(_Readable(otlp, resource), **batching)  # type: ignore[arg-type]
            return cls(resource, processor)
        logger.info("OTLP spans encoded %s", prefer_native())
        sender = _OTLPBytes(client, otlp, resource)
        return cls(resource, queue=SpanQueue(sender, MAX_QUEUE, EXPORT_BATCH))

    @classmethod
    def to(cls, exporter: SpanExporter, service: str) -> Tracing:
        """Export each request's spans as it ends, synchronously, to any SDK exporter
        as the SDK's own ``ReadableSpan`` records (tests' in-memory exporter)."""
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        resource = _resource(service)
        return cls(resource, SimpleSpanProcessor(_Readable(exporter, resource)))  # type: ignore[arg-type]

    def emit(
        self, root: SpanRecord, context: TraceParent, parent_span_id: int | None, clock: Clock
    ) -> None:
        """Queue ``root`` and its children for export: ``root`` is the span ``context``
        names, a child of ``parent_span_id`` (``None``: the trace's root). Nothing is
        queued for a trace that is not sampled."""
        if not context.sampled:
            return
        offset = self.unix_offset(clock)
        tree = SpanTree(
            root, context.trace_id, context.span_id, parent_span_id, context.flags, offset
        )
        if self.queue is not None:
            self.queue.put(encode_tree(tree))
        elif self.processor is not None:
            self.processor.on_end(tree)  # type: ignore[arg-type]  # the processor only queues it

    def emit_encoded(self, spans: bytes) -> None:
        """Queue spans already encoded (``otlp.encode_tree``'s bytes, of a sampled
        trace); only where ``encoded``."""
        if self.queue is None:
            raise RuntimeError("this Tracing takes span records: use emit")
        self.queue.put(spans)

    @staticmethod
    def unix_offset(clock: Clock) -> float:
        """What turns ``clock``'s readings into Unix time, now."""
        return time.time() - clock.now()

    def shutdown(self) -> None:
        """Send what is queued, for at most ``SHUTDOWN_S`` (a hung collector does not hold
        the process: the export thread is a daemon)."""
        if self.queue is not None:
            self.queue.shutdown(SHUTDOWN_S)
            return
        processor = self.processor
        assert processor is not None
        done = threading.Thread(target=processor.shutdown, daemon=True)
        done.start()
        done.join(SHUTDOWN_S)


def _batching() -> dict[str, int | None]:
    """The SDK batch processor's queue and batch sizes: ours unless the environment sets
    them (``None``: the SDK reads, checks and defaults it)."""
    if os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE"):
        return {"max_queue_size": None, "max_export_batch_size": None}
    batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH
    return {"max_queue_size": MAX_QUEUE, "max_export_batch_size": batch}


def _resource(service: str) -> Resource:
    """This process's resource: ``service`` as its name unless OTEL_SERVICE_NAME says,
    with OTEL_RESOURCE_ATTRIBUTES and the SDK's own."""
    from opentelemetry.sdk.resources import Resource

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    return Resource.create(attributes)


def _resource_attributes(resource: Resource) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    for key, value in resource.attributes.items():
        if isinstance(value, str | bool | int | float):
            out[key] = value
        elif isinstance(value, Sequence):
            out[key] = [str(v) for v in value]
    return out


class _OTLPBytes:
    """Encoded trees (``otlp.py``), joined into one request a batch and sent over the
    SDK's OTLP/HTTP exporter's client (its retries, compression, headers, certificates)."""

    def __init__(self, client: Any, otlp: Any, resource: Resource) -> None:
        self.client, self.otlp = client, otlp
        self.parts = encode_resource(_resource_attributes(resource), "sendpath", __version__)

    def send(self, batch: list[bytes]) -> bool:
        return bool(self.client.export(encode_request(*self.parts, batch)).success)

    def shutdown(self) -> None:
        self.otlp.shutdown()


class _Readable:
    """Any SDK exporter, fed ``SpanTree`` batches as ``ReadableSpan`` records."""

    def __init__(self, exporter: SpanExporter, resource: Resource) -> None:
        self.exporter, self.resource = exporter, resource

    def export(self, trees: Sequence[SpanTree]) -> Any:
        return self.exporter.export(readable_spans(trees, self.resource))

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def readable_spans(trees: Sequence[SpanTree], resource: Resource) -> list[ReadableSpan]:
    """The trees as the SDK's own span records (the slow, general path)."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    scope = InstrumentationScope("sendpath", __version__)
    kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}
    out: list[ReadableSpan] = []
    for tree in trees:
        flags = TraceFlags(tree.flags & 0xFF)

        def ns(t: float, offset: float = tree.offset) -> int:
            return int((t + offset) * 1e9)

        tree.root.span_id = tree.span_id
        parents: dict[int, SpanContext | None] = {}
        if tree.parent_span_id is not None:
            parents[id(tree.root)] = SpanContext(tree.trace_id, tree.parent_span_id, True, flags)
        pending = [tree.root]  # parents first
        while pending:
            record = pending.pop(0)
            span_id = record.span_id if record.span_id is not None else new_span_id()
            own = SpanContext(tree.trace_id, span_id, False, flags)
            children = record.all_children()
            for child in children:
                parents[id(child)] = own
            pending += children
            attributes: Mapping[str, Any] = record.attributes
            status = Status(StatusCode.UNSET)
            if record.error is not None:
                attributes = {**record.attributes, "error.type": record.error}
                status = Status(StatusCode.ERROR, record.error)
            out.append(
                ReadableSpan(
                    name=record.name,
                    context=own,
                    parent=parents.get(id(record)),
                    resource=resource,
                    attributes=attributes,
                    events=[Event(name, timestamp=ns(t)) for name, t in record.events],
                    kind=kinds.get(record.kind, SpanKind.INTERNAL),
                    status=status,
                    start_time=ns(record.start),
                    end_time=ns(max(record.start, record.end)),
                    instrumentation_scope=scope,
                )
            )
    return out
