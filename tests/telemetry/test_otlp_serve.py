"""End to end on real processes: `sendpath serve --otlp-traces-endpoint` exports to an
OTLP/HTTP receiver on loopback, which decodes the protobuf and finds one trace holding the
gateway's and the replica's spans for a chat sent with a traceparent."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_serve, wait_for
from tests.telemetry.collector import Receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_serve_exports_one_trace_across_gateway_and_replica(
    tiny_llama_dir: Path, tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the processes inherit it
    served = start_serve(
        tiny_llama_dir, tmp_path, "--no-auth", "--otlp-traces-endpoint", receiver.url, replicas=1
    )
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = httpx.post(
            served.url + "/v1/chat/completions",
            json=body,
            headers={"traceparent": CALLER},
            timeout=60,
        )
        assert r.status_code == 200

        def both() -> bool:
            services = {s for s, span in receiver.of_trace(TRACE_ID) if span.kind == 2}
            return services == {"sendpath-gateway", "sendpath-replica"}  # 2: SERVER

        wait_for(both, timeout=60)
    finally:
        served.proc.send_signal(signal.SIGTERM)
        served.proc.communicate(timeout=60)
    spans = receiver.of_trace(TRACE_ID)
    gateway = {span.name: span for s, span in spans if s == "sendpath-gateway"}
    replica = {span.name: span for s, span in spans if s == "sendpath-replica"}
    root = gateway["chat tiny"]
    assert root.parent_span_id.hex() == "00f067aa0ba902b7"  # the caller's span
    attempt = gateway["attempt replica-0"]
    assert attempt.parent_span_id == root.span_id
    assert replica["chat tiny"].parent_span_id == attempt.span_id  # across the processes
    assert {"tokenize", "engine.queue", "prefill", "decode"} <= set(replica)
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 3
    assert attributes["gen_ai.response.id"].string_value == r.json()["id"]
