"""Sending ``SpanRecord`` trees to an OpenTelemetry collector over OTLP/HTTP (protobuf).

Off unless ``--otlp-traces-endpoint`` is given or the standard environment names an
endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``, to
which the exporter adds ``/v1/traces``); ``OTEL_SDK_DISABLED=true`` turns it off whatever
is given. The exporter reads the rest of the standard variables itself
(``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``, certificates), and the
resource takes ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.

A finished request's spans are handed to the SDK's ``BatchSpanProcessor`` as the SDK's own
``ReadableSpan`` records, with the times the request's event list already holds (no span
is started live, so there is no second clock and nothing to end on every path). The
processor queues them (bounded: past ``MAX_QUEUE`` spans it drops, never blocks) and a
thread of its own exports them in batches, so a collector that refuses or hangs costs a
request nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sendpath import __version__
from sendpath.clock import Clock
from sendpath.extras import require
from sendpath.telemetry.spans import SpanRecord
from sendpath.telemetry.trace_context import TraceParent, new_span_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["MAX_QUEUE", "Tracing", "traces_endpoint"]

MAX_QUEUE = 4096  # spans waiting for export; more are dropped
SHUTDOWN_S = 3.0  # at exit, how long the last spans may take to go out


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
    """Where one process's spans go: its resource (service name), and the processor."""

    def __init__(self, service: str, processor: SpanProcessor) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
        self.resource = Resource.create(attributes)
        self.scope = InstrumentationScope("sendpath", __version__)
        self.processor = processor

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

        exporter = OTLPSpanExporter(endpoint=endpoint)  # None: the environment's
        return cls(service, BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUE))

    @classmethod
    def to(cls, exporter: SpanExporter, service: str) -> Tracing:
        """Export each span as it is emitted, synchronously (tests' in-memory exporter)."""
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        return cls(service, SimpleSpanProcessor(exporter))

    def emit(
        self, root: SpanRecord, context: TraceParent, parent_span_id: int | None, clock: Clock
    ) -> None:
        """Hand ``root`` and its children to the processor: ``root`` is the span
        ``context`` names, a child of ``parent_span_id`` (``None``: the trace's root).
        Nothing is exported for a trace that is not sampled."""
        if not context.sampled:
            return
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}
        flags = TraceFlags(context.flags & 0xFF)
        offset = time.time() - clock.now()  # this clock's readings as Unix time

        def ns(t: float) -> int:
            return int((t + offset) * 1e9)

        root.span_id = context.span_id
        parents: dict[int, SpanContext | None] = {}
        if parent_span_id is not None:
            parents[id(root)] = SpanContext(context.trace_id, parent_span_id, True, flags)
        for record in root.walk():
            span_id = record.span_id if record.span_id is not None else new_span_id()
            own = SpanContext(context.trace_id, span_id, False, flags)
            for child in record.children:
                parents[id(child)] = own
            attributes: Mapping[str, Any] = record.attributes
            status = Status(StatusCode.UNSET)
            if record.error is not None:
                attributes = {**record.attributes, "error.type": record.error}
                status = Status(StatusCode.ERROR, record.error)
            span = ReadableSpan(
                name=record.name,
                context=own,
                parent=parents.get(id(record)),
                resource=self.resource,
                attributes=attributes,
                events=[Event(name, timestamp=ns(t)) for name, t in record.events],
                kind=kinds.get(record.kind, SpanKind.INTERNAL),
                status=status,
                start_time=ns(record.start),
                end_time=ns(max(record.start, record.end)),
                instrumentation_scope=self.scope,
            )
            self.processor.on_end(span)

    def shutdown(self) -> None:
        """Send what is queued, for at most ``SHUTDOWN_S`` (a hung collector does not hold
        the process: the export thread is a daemon)."""
        done = threading.Thread(target=self.processor.shutdown, daemon=True)
        done.start()
        done.join(SHUTDOWN_S)
