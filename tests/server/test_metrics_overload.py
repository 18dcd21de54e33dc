"""/metrics parses and moves; past --max-queued-requests the replica answers 503."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sendpath.model.loader import LoadedModel
from tests.conftest import wait_for
from tests.server.conftest import Server, serve

NAMES = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "e2e_request_latency_seconds",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
]


def scrape(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or (
                set(sample.labels) == {"le"} and sample.labels["le"] == "+Inf"
            ):
                out[sample.name] = sample.value
    return out


def test_metrics_parse_and_move(server: Server) -> None:
    before = scrape(server)
    for name in NAMES:
        assert any(k.startswith(f"sendpath:{name}") for k in before), name
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 5,
            "ignore_eos": True,
        },
    )
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    after = scrape(server)
    assert (
        after["sendpath:prompt_tokens_total"] - before["sendpath:prompt_tokens_total"]
        == prompt_tokens
    )
    assert (
        after["sendpath:generation_tokens_total"] - before["sendpath:generation_tokens_total"] == 5
    )
    assert (
        after["sendpath:e2e_request_latency_seconds_count"]
        - before["sendpath:e2e_request_latency_seconds_count"]
        == 1
    )
    assert (
        after["sendpath:inter_token_latency_seconds_count"]
        - before["sendpath:inter_token_latency_seconds_count"]
        == 4
    )
    assert (
        after["sendpath:prefix_cache_queries_total"]
        >= before["sendpath:prefix_cache_queries_total"] + prompt_tokens
    )
    assert after["sendpath:num_requests_running"] == 0


def test_overload_answers_503_with_retry_after(tiny: LoadedModel) -> None:
    with serve(tiny, max_num_seqs=1, max_queued_requests=1) as server:
        body = {
            "model": "tiny",
            "prompt": "go",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        stop = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        def load() -> tuple[int, int]:
            found = httpx.get(f"{server.url}/load").json()
            return found["num_requests_running"], found["num_requests_waiting"]

        holders = [threading.Thread(target=hold) for _ in range(2)]
        holders[0].start()
        wait_for(lambda: load() == (1, 0))  # the first runs
        holders[1].start()
        wait_for(lambda: load() == (1, 1))  # the second waits
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        stop.set()
        for t in holders:
            t.join(30)
        assert server.idle()


def test_vllm_named_gauges_carry_the_model_name(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        vllm = samples[f"vllm:{name}"]
        assert vllm.labels == {"model_name": "tiny"}
        assert vllm.value == samples[f"sendpath:{name}"].value
