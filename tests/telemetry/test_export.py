"""Span trees to the SDK: parents, times, errors, sampling; and when export is on at all."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sendpath.clock import VirtualClock
from sendpath.telemetry import export
from sendpath.telemetry.export import EXPORT_BATCH, MAX_QUEUE, Tracing, _batching, traces_endpoint
from sendpath.telemetry.spans import SpanRecord
from sendpath.telemetry.trace_context import TraceParent
from tests.conftest import wait_for

OTEL_ENV = (
    "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


def tree() -> SpanRecord:
    root = SpanRecord("chat tiny", 10.0, 12.0, "server", {"gen_ai.operation.name": "chat"})
    root.children = [
        SpanRecord("gateway.auth", 10.0, 10.1),
        SpanRecord("attempt replica-0", 10.2, 11.0, "client", span_id=0xABC, error="502"),
        SpanRecord("attempt replica-1", 11.0, 12.0, "client", events=[("preempted", 11.5)]),
    ]
    root.stages = [("gateway.safety", 10.1, 10.15), ("stream", 11.9, 10.0)]  # ends < starts
    return root


def test_a_tree_becomes_spans_with_its_parents_times_and_errors() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing.to(exporter, "sendpath-gateway")
    context = TraceParent(0x1234, 0x99)
    tracing.emit(tree(), context, 0x77, VirtualClock(10.0))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    names = {"chat tiny", "gateway.auth", "attempt replica-0", "attempt replica-1"}
    assert set(spans) == names | {"gateway.safety", "stream"}
    root = spans["chat tiny"]
    assert root.context is not None and root.parent is not None
    assert (root.context.trace_id, root.context.span_id) == (0x1234, 0x99)
    assert root.parent.span_id == 0x77 and root.parent.is_remote and root.kind is SpanKind.SERVER
    failed = spans["attempt replica-0"]
    assert failed.context is not None and failed.context.span_id == 0xABC  # as sent on
    assert failed.status.status_code is StatusCode.ERROR and failed.attributes is not None
    assert failed.attributes["error.type"] == "502" and failed.kind is SpanKind.CLIENT
    for name in ("gateway.auth", "attempt replica-0", "attempt replica-1", "gateway.safety"):
        span = spans[name]
        assert span.parent is not None and span.parent.span_id == 0x99
        assert span.context is not None and span.context.trace_id == 0x1234
    assert root.start_time is not None and root.end_time is not None
    assert root.end_time - root.start_time == pytest.approx(2e9, abs=1e3)  # from the records
    auth = spans["gateway.auth"]
    assert auth.start_time == root.start_time
    (event,) = spans["attempt replica-1"].events
    assert event.name == "preempted" and event.timestamp - root.start_time == pytest.approx(1.5e9)
    assert root.resource.attributes["service.name"] == "sendpath-gateway"


def test_a_trace_the_caller_does_not_sample_is_not_exported() -> None:
    exporter = InMemorySpanExporter()
    Tracing.to(exporter, "s").emit(tree(), TraceParent(1, 2, flags=0), None, VirtualClock())
    assert exporter.get_finished_spans() == ()


def test_export_is_off_unless_a_flag_or_the_environment_names_a_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Tracing.configured(None, "s") is None
    assert Tracing.configured("http://127.0.0.1:1/v1/traces", "s") is not None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert Tracing.configured(None, "s") is not None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Tracing.configured("http://127.0.0.1:1/v1/traces", "s") is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match="http/protobuf"):
        Tracing.configured(None, "s")


def test_the_service_name_is_the_environments_when_it_gives_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    tracing = Tracing.to(InMemorySpanExporter(), "sendpath-gateway")
    assert tracing.resource.attributes["service.name"] == "edge-gateway"


def test_the_endpoint_flag_is_checked_and_completed() -> None:
    assert traces_endpoint(None) is None
    assert traces_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_endpoint("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    for bad in ("c:4318", "ftp://c/v1/traces", "http://"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint takes an http"):
            traces_endpoint(bad)


@pytest.mark.parametrize("caller", [0x77, None], ids=["continued", "root"])
def test_the_direct_encoding_is_the_sdks_encoding_of_the_same_spans(
    caller: int | None, encoder: str
) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from sendpath.telemetry.export import _resource, _resource_attributes, readable_spans
    from sendpath.telemetry.otlp import SpanTree, encode_request, encode_resource, encode_tree

    root = tree()
    root.attributes.update(
        {"n": -3, "ok": True, "ratio": 0.25, "reasons": ["stop", "length"], "text": "é"}
    )
    root.children[0].children = [SpanRecord("nested", 10.0, 10.05)]  # parents first
    root.children[2].stages = [("nested stage", 11.1, 11.2)]
    for number, record in enumerate(root.walk()[1:], start=1):
        record.span_id = record.span_id or number  # the same ids on both sides
    trees = [SpanTree(root, 0x1234, 0x99, caller, 1, 1_700_000_000.0)]
    resource = _resource("sendpath-gateway")
    parts = encode_resource(_resource_attributes(resource), "sendpath", "0.1.0")
    encoded = encode_request(*parts, [encode_tree(t) for t in trees])
    ours = ExportTraceServiceRequest.FromString(encoded)
    sdk = encode_spans(readable_spans(trees, resource))
    (ours_rs,), (sdk_rs,) = ours.resource_spans, sdk.resource_spans
    assert ours_rs.resource == sdk_rs.resource
    (ours_ss,), (sdk_ss,) = ours_rs.scope_spans, sdk_rs.scope_spans
    assert ours_ss.scope.name == sdk_ss.scope.name == "sendpath"
    assert len(ours_ss.spans) == len(sdk_ss.spans) == 8
    stages = {"gateway.safety", "stream", "nested stage"}  # bare stages: their ids are drawn
    for spans in (ours_ss.spans, sdk_ss.spans):
        for span in spans:
            if span.name in stages:
                assert len(span.span_id) == 8 and span.span_id != bytes(8)
                span.span_id = b""
    by_name = (
        sorted(ours_ss.spans, key=lambda s: s.name),
        sorted(sdk_ss.spans, key=lambda s: s.name),
    )
    for a, b in zip(*by_name, strict=True):
        assert a == b, (a, b)


def test_batches_are_ours_unless_the_environment_sizes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _batching() == {"max_queue_size": MAX_QUEUE, "max_export_batch_size": EXPORT_BATCH}
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "100")
    assert _batching() == {"max_queue_size": MAX_QUEUE, "max_export_batch_size": None}
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "1000")  # the SDK checks the pair
    assert _batching() == {"max_queue_size": None, "max_export_batch_size": None}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    tracing = Tracing.configured(None, "s")
    assert tracing is not None
    tracing.shutdown()


def test_the_exporter_encodes_in_c_where_it_builds_and_says_so(
    native: object, caplog: pytest.LogCaptureFixture
) -> None:
    from sendpath.telemetry import otlp

    with caplog.at_level(logging.INFO, logger="sendpath.telemetry"):
        tracing = Tracing.configured("http://127.0.0.1:1/v1/traces", "s")
    try:
        assert tracing is not None and tracing.encoded
        assert "OTLP spans encoded in C (telemetry/otlp_native.c)" in caplog.text
        assert otlp._native is not None
    finally:
        otlp.prefer_native(False)
        assert tracing is not None
        tracing.shutdown()


def test_shutdown_stops_the_retries_to_a_collector_that_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past its time, shutdown ends the OTLP client's backoff: the export thread does not
    go on retrying (for half a minute, six tries) in a process that goes on."""
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "600")  # the tries, not a deadline
    monkeypatch.setattr(export, "SHUTDOWN_S", 0.05)
    tracing = Tracing.configured(f"http://127.0.0.1:{port}/v1/traces", "s")
    assert tracing is not None and tracing.queue is not None
    with caplog.at_level(logging.WARNING):
        tracing.emit(tree(), TraceParent(0x1234, 0x99), None, VirtualClock(10.0))
        wait_for(lambda: "retrying in" in caplog.text)  # refused once: backing off
        tracing.shutdown()
    thread = tracing.queue._thread
    assert thread is not None
    thread.join(20)  # the six tries' backoffs add up to 25-37 s
    assert not thread.is_alive()
