"""OpenTelemetry spans of real requests through a real gateway and a real replica, each
exporting to the SDK's in-memory exporter: one trace across both (the caller's, when it
sends a traceparent), the GenAI names and attributes, a retry as sibling attempts, an
error's status; and a collector that hangs costs a request nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sendpath.config import GatewayConfig
from sendpath.gateway.app import create_gateway_app
from sendpath.model.loader import LoadedModel
from sendpath.telemetry.export import Tracing
from tests.conftest import wait_for
from tests.gateway.conftest import CHAT, gateway
from tests.gateway.test_hardening import mocked
from tests.server.conftest import Server, serve, serve_app
from tests.telemetry.collector import Receiver

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER = f"00-{TRACE_ID:032x}-00f067aa0ba902b7-01"
GATEWAY_STAGES = ["gateway.auth", "gateway.ratelimit", "gateway.safety", "gateway.queue"]


@pytest.fixture(scope="module")
def replica_spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced_replica(tiny: LoadedModel, replica_spans: InMemorySpanExporter) -> Iterator[Server]:
    with serve(tiny, tracing=Tracing.to(replica_spans, "sendpath-replica")) as s:
        yield s


@pytest.fixture
def spans(replica_spans: InMemorySpanExporter) -> InMemorySpanExporter:
    replica_spans.clear()
    return InMemorySpanExporter()


def by_trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and s.context.trace_id == trace_id
    ]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    return sorted(kids, key=lambda s: s.start_time or 0)


def test_a_streamed_chat_is_one_trace_across_the_gateway_and_its_replica(
    traced_replica: Server,
    spans: InMemorySpanExporter,
    replica_spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    body = {**CHAT, "max_tokens": 5, "temperature": 0.5, "stream": True}
    tracing = Tracing.to(spans, "sendpath-gateway")
    with gateway(traced_replica, tmp_path, tracing=tracing) as gw:
        secret = gw.key("team-a")
        headers = {"Authorization": f"Bearer {secret}", "traceparent": CALLER}
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        wait_for(lambda: len(by_trace(spans, TRACE_ID)) >= 8)
    ours = by_trace(spans, TRACE_ID)
    (root,) = [s for s in ours if s.kind is SpanKind.SERVER]
    assert root.name == "chat tiny" and root.parent is not None
    assert root.parent.span_id == 0x00F067AA0BA902B7 and root.parent.is_remote
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    assert a["sendpath.key.name"] == "team-a" and a["sendpath.replica"] == "replica-0"
    assert a["sendpath.routing.policy"] == "prefix_aware"
    assert a["gen_ai.response.time_to_first_chunk"] > 0
    assert secret not in repr(a) and "hello there" not in repr(a)  # no key, no prompt
    assert root.status.status_code is StatusCode.UNSET
    names = [s.name for s in children(ours, root)]
    assert names == [*GATEWAY_STAGES, "route", "attempt replica-0", "stream"]
    (attempt,) = [s for s in ours if s.kind is SpanKind.CLIENT]
    assert attrs(attempt)["http.response.status_code"] == 200
    # the replica's span hangs under the attempt that reached it, in the same trace
    wait_for(lambda: len(by_trace(replica_spans, TRACE_ID)) >= 5)
    theirs = by_trace(replica_spans, TRACE_ID)
    (served,) = [s for s in theirs if s.kind is SpanKind.SERVER]
    assert attempt.context is not None and served.parent is not None
    assert served.parent.span_id == attempt.context.span_id
    assert served.name == "chat tiny" and served.resource.attributes["service.name"] == (
        "sendpath-replica"
    )
    assert attrs(served)["gen_ai.response.id"] == a["gen_ai.response.id"]
    assert attrs(served)["gen_ai.usage.output_tokens"] == 5
    stages = [s.name for s in children(theirs, served)]
    assert stages == ["tokenize", "engine.queue", "prefill", "decode"]
    for stage in children(theirs, served):  # inside their parent, in time
        assert stage.start_time is not None and stage.end_time is not None
        assert served.start_time is not None and served.end_time is not None
        assert served.start_time <= stage.start_time <= stage.end_time <= served.end_time


def test_a_retry_is_a_sibling_attempt_and_a_refusal_an_error_span(
    traced_replica: Server, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    tracing = Tracing.to(spans, "sendpath-gateway")
    with mocked("crash-500") as (_, bad):
        config = GatewayConfig(
            replicas=(bad, traced_replica.url),
            data_dir=str(tmp_path),
            require_keys=False,
            policy="round_robin",
        )
        with serve_app(create_gateway_app(config, tracing=tracing)) as url:
            headers = {"traceparent": CALLER}
            body = {**CHAT, "max_tokens": 2}
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200
            wait_for(lambda: any(s.kind is SpanKind.SERVER for s in by_trace(spans, TRACE_ID)))
    ours = by_trace(spans, TRACE_ID)
    (root,) = [s for s in ours if s.kind is SpanKind.SERVER]
    first, second = [s for s in children(ours, root) if s.kind is SpanKind.CLIENT]
    assert (first.name, second.name) == ("attempt replica-0", "attempt replica-1")
    assert first.status.status_code is StatusCode.ERROR and attrs(first)["error.type"] == "HTTP 502"
    assert attrs(first)["http.response.status_code"] == 500
    assert second.status.status_code is StatusCode.UNSET
    assert first.end_time is not None and second.start_time is not None
    assert first.end_time <= second.start_time


def test_a_refused_request_is_an_error_span_and_an_unsampled_one_is_not_exported(
    traced_replica: Server, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    with gateway(traced_replica, tmp_path, tracing=Tracing.to(spans, "sendpath-gateway")) as gw:
        r = gw.post("sk-sp-not-a-key", CHAT)
        assert r.status_code == 401
        wait_for(lambda: len(spans.get_finished_spans()) >= 1)
        (root,) = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
        assert root.name == "chat" and root.status.status_code is StatusCode.ERROR
        assert attrs(root)["error.type"] == "401"
        spans.clear()
        unsampled = CALLER[:-2] + "00"
        headers = {"Authorization": f"Bearer {gw.key('a')}", "traceparent": unsampled}
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert r.status_code == 200
        r = gw.post(gw.key("b"), {**CHAT, "max_tokens": 1})  # then one that is sampled
        wait_for(lambda: len(spans.get_finished_spans()) >= 1)
        assert all(s.context and s.context.trace_id != TRACE_ID for s in spans.get_finished_spans())


def test_with_tracing_off_nothing_is_built_and_no_traceparent_is_sent(
    traced_replica: Server,
    spans: InMemorySpanExporter,
    replica_spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    with gateway(traced_replica, tmp_path) as gw:  # the replica's exporter is cleared
        assert gw.app.state.parts.tracing is None
        assert gw.post(gw.key("a"), {**CHAT, "max_tokens": 1}).status_code == 200
    wait_for(lambda: len(replica_spans.get_finished_spans()) >= 1)
    served = [s for s in replica_spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.parent for s in served] == [None]  # a trace of the replica's own


def test_a_collector_that_hangs_or_refuses_costs_requests_nothing(
    traced_replica: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export at once, not after 5 s
    hung = Receiver(hold=True)
    try:
        tracing = Tracing.configured(hung.url, "sendpath-gateway")
        with gateway(traced_replica, tmp_path / "hung", tracing=tracing) as gw:
            secret = gw.key("a")
            assert gw.post(secret, {**CHAT, "max_tokens": 1}).status_code == 200
            assert hung.received.wait(30)  # the export thread is now held by the collector
            for _ in range(3):  # answered while it stays held
                assert gw.post(secret, {**CHAT, "max_tokens": 1}).status_code == 200
            assert not hung.release.is_set()
    finally:
        hung.close()
    refusing = Tracing.configured("http://127.0.0.1:9/v1/traces", "sendpath-gateway")
    with gateway(traced_replica, tmp_path / "refused", tracing=refusing) as gw:
        secret = gw.key("a")
        for _ in range(3):
            assert gw.post(secret, {**CHAT, "max_tokens": 1}).status_code == 200


def test_the_genai_server_metrics_count_answers_and_refusals(
    traced_replica: Server, tmp_path: Path
) -> None:
    with gateway(traced_replica, tmp_path) as gw:
        secret = gw.key("a")
        assert gw.post(secret, {**CHAT, "max_tokens": 4}).status_code == 200
        assert len(gw.stream(secret, {**CHAT, "max_tokens": 4})) > 2
        assert gw.post("sk-sp-not-a-key", CHAT).status_code == 401
        text = httpx.get(gw.url + "/metrics", timeout=10).text
    labels = 'gen_ai_operation_name="chat",gen_ai_request_model="tiny"'
    assert f'gen_ai_server_request_duration_seconds_count{{error_type="",{labels}}} 2.0' in text
    assert f"gen_ai_server_time_to_first_token_seconds_count{{{labels}}} 2.0" in text
    assert f"gen_ai_server_time_per_output_token_seconds_count{{{labels}}} 2.0" in text
    refused = 'error_type="401",gen_ai_operation_name="chat",gen_ai_request_model=""'
    assert f"gen_ai_server_request_duration_seconds_count{{{refused}}} 1.0" in text
    replica = httpx.get(traced_replica.url + "/metrics", timeout=10).text
    assert "gen_ai_server_time_per_output_token_seconds_count{" in replica
