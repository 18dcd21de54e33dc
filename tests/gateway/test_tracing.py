"""The stitched trace: complete and consistent for streamed and whole answers, through one
and several replicas, readable only by its key; the stage histograms in /metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sendpath.config import GatewayConfig
from sendpath.gateway.app import create_gateway_app
from sendpath.model.loader import LoadedModel
from tests.gateway.conftest import CHAT, gateway
from tests.server.conftest import Server, serve, serve_app

ORDER = [
    "gateway.auth", "gateway.ratelimit", "gateway.safety", "gateway.queue", "route",
    "tokenize", "engine.queue", "prefill", "decode", "stream",
]  # fmt: skip
# The stages tile the gateway's total: each starts where the last ended, and their sum is
# the total up to the rounding of each stage to 1 microsecond.
TOLERANCE_MS = 0.001 * len(ORDER)


def get_trace(url: str, secret: str | None, request_id: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get(f"{url}/v1/traces/{request_id}", headers=headers)


def check_consistent(trace: dict[str, Any], completion_tokens: int) -> None:
    stages = trace["stages"]
    assert [s["stage"] for s in stages] == ORDER
    t = 0.0
    for s in stages:
        assert s["duration_ms"] >= 0
        assert s["start_ms"] == pytest.approx(t, abs=TOLERANCE_MS)
        t = s["start_ms"] + s["duration_ms"]
    total = trace["timings"]["total"]
    assert t == pytest.approx(total, abs=TOLERANCE_MS)
    assert sum(trace["timings"][name] for name in ORDER) == pytest.approx(total, abs=TOLERANCE_MS)
    tokens = trace["tokens_ms"]
    assert len(tokens) == completion_tokens and tokens == sorted(tokens)
    prefill_end = stages[7]["start_ms"] + stages[7]["duration_ms"]
    assert tokens[0] == pytest.approx(prefill_end, abs=0.01)  # the first token ends prefill
    assert tokens[-1] <= total
    types = [e["type"] for e in trace["events"]]
    assert types[0] == "arrived" and types[-1] == "finished" and "first_token" in types


def test_streamed_and_whole_answers_have_complete_consistent_traces(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("alice")
        events = gw.stream(secret, {**CHAT, "max_tokens": 6, "ignore_eos": True})
        request_id = next(e["id"] for e in events if isinstance(e, dict))
        trace = get_trace(gw.url, secret, request_id).json()
        check_consistent(trace, 6)
        assert trace["id"] == request_id and trace["replica"] == "replica-0"
        assert replica.url not in json.dumps(trace)  # clients never see addresses
        # every chunk reached the client after its tokens. There may be fewer chunks than
        # tokens: the output filter holds a token that could start a blocked phrase (random
        # text can, anywhere) and a token of half a character waits for the rest; so
        # chunk i carries token i or later ones, and the first waited for the held ones
        last = next(e for e in reversed(events) if isinstance(e, dict) and "timings" in e)
        relayed, tokens = trace["relayed_ms"], trace["tokens_ms"]
        assert 1 <= len(relayed) <= 6 - last["first_token_held"] and relayed == sorted(relayed)
        assert all(r >= t for r, t in zip(relayed, tokens, strict=False))
        assert relayed[0] >= tokens[last["first_token_held"]]
        r = gw.post(secret, {**CHAT, "max_tokens": 5, "ignore_eos": True})
        assert r.headers["x-request-id"] == r.json()["id"]
        trace = get_trace(gw.url, secret, r.json()["id"]).json()
        check_consistent(trace, 5)
        assert trace["timings"] == r.json()["timings"]
        # only the key that made the request may read it; unknown ids are 404 too
        other = gw.key("bob")
        assert get_trace(gw.url, other, request_id).status_code == 404
        assert get_trace(gw.url, None, request_id).status_code == 401
        missing = get_trace(gw.url, secret, "chatcmpl-nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "trace_not_found"
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'sendpath:stage_seconds_count{stage="prefill"} 2.0' in metrics
        assert f'sendpath:replica_healthy{{replica="{replica.url}"}} 1.0' in metrics
        assert 'sendpath:gateway_responses_total{code="404"}' in metrics


def test_traces_through_two_replicas_name_theirs(tiny: LoadedModel, tmp_path: Path) -> None:
    with serve(tiny) as r1, serve(tiny) as r2:
        config = GatewayConfig(
            replicas=(r1.url, r2.url),
            data_dir=str(tmp_path),
            require_keys=False,
            policy="round_robin",
        )
        with serve_app(create_gateway_app(config)) as url:
            seen = set()
            for _ in range(4):
                r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3})
                trace = get_trace(url, None, r.json()["id"]).json()
                assert trace["replica"] == r.headers["x-sendpath-replica"]
                check_consistent(trace, r.json()["usage"]["completion_tokens"])
                seen.add(trace["replica"])
            assert seen == {"replica-0", "replica-1"}


def test_progress_follows_a_request_through_prefill(tiny: LoadedModel, tmp_path: Path) -> None:
    with serve(tiny, max_num_batched_tokens=8) as slow, gateway(slow, tmp_path) as gw:
        secret, other = gw.key("p"), gw.key("q")
        body = {"model": "tiny", "prompt": [7] * 1500, "max_tokens": 2, "stream": True}
        headers = {"Authorization": f"Bearer {secret}", "x-sendpath-client-id": "c-1"}
        done = threading.Event()

        def run() -> None:
            with httpx.stream(
                "POST", gw.url + "/v1/completions", json=body, headers=headers, timeout=120
            ) as r:
                r.read()
            done.set()

        threading.Thread(target=run).start()
        seen: list[dict[str, Any]] = []
        while not done.is_set():
            r = httpx.get(
                gw.url + "/v1/progress/c-1", headers={"Authorization": f"Bearer {secret}"}
            )
            if r.status_code == 200:
                seen.append(r.json())
            time.sleep(0.02)
        prefill = [p for p in seen if p["stage"] == "prefill"]
        assert prefill, [p["stage"] for p in seen]
        assert prefill[0]["engine"]["num_prompt_tokens"] == 1500
        fractions = [p["prefill_done"] for p in prefill]  # 0 when seen before its first chunk
        assert fractions == sorted(fractions) and any(0 < f < 1 for f in fractions), fractions
        r = httpx.get(gw.url + "/v1/progress/c-1", headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 404  # finished (and never another key's)
