"""The report's numbers on hand-made results: vLLM's definitions, stage shares, goodput."""

from __future__ import annotations

import pytest

from sendpath.bench.client import RequestResult
from sendpath.bench.report import dominant, summarize


def result(
    ttft: float, latency: float, tokens: int, timings: dict[str, float] | None = None
) -> RequestResult:
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestResult(
        success=True, prompt_tokens=10, output_tokens=tokens, ttft=ttft, itl=itl,
        latency=latency, timings=timings or {},
    )  # fmt: skip


def test_vllm_metrics_and_goodput() -> None:
    rs = [result(0.1, 1.1, 11), result(0.3, 2.3, 21), RequestResult(error="HTTP 503: busy")]
    report = summarize(rs, duration_s=4.0, goodput_slos_ms={"ttft": 200})
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["total_input_tokens"] == 20 and report["total_output_tokens"] == 32
    assert report["request_throughput"] == 0.5 and report["output_throughput"] == 8.0
    assert report["total_token_throughput"] == 13.0
    assert report["mean_ttft_ms"] == pytest.approx(200.0)
    assert report["median_tpot_ms"] == pytest.approx(100.0)  # both requests: 100 ms/token
    assert report["mean_itl_ms"] == pytest.approx(100.0)
    assert report["p99_e2el_ms"] == pytest.approx(2288.0)
    assert report["request_goodput"] == 0.25  # only the first met TTFT <= 200 ms
    assert report["errors"] == ["HTTP 503: busy"]


def test_stage_shares_include_network_and_name_the_dominant_group() -> None:
    # E2EL 1000 ms; the server's total 990 ms, so 10 ms of network each
    rs = [
        result(0.2, 1.0, 5, {"engine.queue": 600.0, "prefill": 100.0, "decode": 290.0,
                             "ttft": 200.0, "total": 990.0}),
    ] * 2  # fmt: skip
    stages = summarize(rs, 2.0)["stages"]
    assert list(stages) == ["engine.queue", "prefill", "decode", "network"]
    assert stages["engine.queue"] == {"mean_ms": 600.0, "share": 0.6}
    assert stages["network"]["mean_ms"] == pytest.approx(10.0)
    group, share, why = dominant(stages)  # type: ignore[misc]
    assert group == "queue" and share == pytest.approx(0.6) and "waited for a slot" in why
    assert summarize([result(0.1, 1.0, 3)], 1.0)["stages"] == {}  # no timings reported


def test_a_stage_one_result_did_not_report_counts_as_zero_in_its_mean() -> None:
    rs = [
        result(0.1, 1.0, 3, {"prefill": 100.0, "total": 100.0}),
        result(0.1, 1.0, 3, {"prefill": 300.0, "decode": 500.0, "total": 800.0}),
    ]
    stages = summarize(rs, 1.0)["stages"]
    assert stages["prefill"]["mean_ms"] == 200.0 and stages["decode"]["mean_ms"] == 250.0
    one = summarize([result(0.1, 1.0, 3, {"prefill": 40.0})] * 3, 1.0)["stages"]
    assert one["prefill"] == {"mean_ms": 40.0, "share": 0.04}
