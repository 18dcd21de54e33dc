"""The overloaded scenario: a capacity probe, then twice that load, against a real server
(a replica of the tiny model whose batch holds 2 sequences, behind a gateway)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sendpath.bench.overload import MAX_WAIT_S, OVERLOAD, ProbeLevel, plan, probe
from sendpath.bench.workload import LengthSpec
from sendpath.cli import main
from sendpath.model.loader import LoadedModel
from tests.gateway.conftest import gateway
from tests.server.conftest import Server, serve, serve_app


@pytest.fixture(scope="module")
def small_batch(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny, max_num_seqs=2) as s:
        yield s


def test_plan_offers_twice_the_best_level_for_a_queue_of_two_service_times() -> None:
    levels = [ProbeLevel(4, 2.0, 1.5), ProbeLevel(8, 4.0, 2.0), ProbeLevel(16, 3.9, 4.1)]
    p = plan(levels)
    # capacity: the best level; service time: the last (saturated) level's latency; the
    # server is taken to hold the last level's 16 at once (it did not say)
    assert OVERLOAD == 2.0 and p.capacity_rps == 4.0 and p.service_s == 4.1 and p.admitted == 16
    # 16 in flight after 16 / 4 = 4 s; then 2 x 2 x 4.1 = 16.4 s of a growing queue:
    # 8/s x 20.4 s = 163.2 -> 164 requests
    assert p.offered_rps == pytest.approx(8.0) and p.num_requests == 164
    assert p.window_s == pytest.approx(164 / 8.0)
    after = p.window_s - 4.0  # the later arrivals wait 0 .. after; the first 4 s none
    assert p.expected_mean_wait_s == pytest.approx(after * after / 2 / p.window_s)
    assert p.queue_can_dominate and "may not dominate" not in p.describe()
    # a server that says it holds 64 at once (a sendpath gateway's /fleet): a request in
    # it takes 64 / 4 = 16 s, and the queue builds only once 64 are in, after 16 s
    deep = plan(levels, admitted=64)
    assert (deep.admitted, deep.service_s) == (64, 16.0)
    assert deep.num_requests == 8 * (16 + 20)  # the longest wait capped at MAX_WAIT_S
    assert deep.expected_mean_wait_s == pytest.approx(20 * 20 / 2 / 36)
    assert not deep.queue_can_dominate  # 5.6 s of queue against 16 s in the batch
    # a slow server: the longest wait stays under the cap, and a mean wait shorter than
    # the service time, which the summary says
    slow = plan([ProbeLevel(64, 2.0, 30.0)])
    assert slow.service_s == 32.0 and slow.num_requests == 4 * (32 + MAX_WAIT_S)
    assert not slow.queue_can_dominate and "the queue may not dominate here" in slow.describe()
    assert slow.report()["queue_can_dominate"] is False
    assert plan(levels, num_requests=10).num_requests == 10
    # a level the server partly refused ends the probe and does not count
    refused = plan([*levels, ProbeLevel(32, 2.0, 30.0, refused=5)])
    assert (refused.capacity_rps, refused.service_s) == (p.capacity_rps, p.service_s)
    assert "32: 5 refused" in refused.describe()
    assert "8.00 requests/s = 2.0x the measured capacity of 4.00/s" in p.describe()
    assert "the server holds 16 at once, each for about 4.1 s" in p.describe()
    with pytest.raises(ValueError, match="measured nothing"):
        plan([ProbeLevel(4, 1.0, 4.0, refused=1)])


def test_overloaded_scenario_probes_then_offers_twice_the_capacity(
    small_batch: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overloaded.json"
    with gateway(small_batch, tmp_path / "gw") as gw:
        argv = ["bench", "--url", gw.url, "--api-key", gw.key("bench"),
                "--scenario", "overloaded", "--num-requests", "48",
                "--json", str(out)]  # fmt: skip
        capacity = httpx.get(gw.url + "/fleet").json()["gateway"]["capacity"]
        assert main(argv) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    overload = report["overload"]
    probed = [level["concurrency"] for level in overload["probe"]]
    assert probed[:2] == [4, 8] and probed == [4 * 2**i for i in range(len(probed))]
    assert overload["capacity_rps"] == max(lv["requests_per_s"] for lv in overload["probe"])
    assert overload["offered_rps"] == pytest.approx(2 * overload["capacity_rps"])
    assert overload["offered_over_capacity"] == 2.0
    assert report["request_rate"] == overload["offered_rps"]
    assert report["completed"] == overload["num_requests"] == 48 and report["failed"] == 0
    assert overload["admitted"] == capacity  # what the gateway said it forwards at once
    printed = capsys.readouterr()
    assert "capacity probe: 4 requests at once" in printed.err
    assert "2.0x the measured capacity" in printed.out and "dominated" in printed.out


def test_a_given_rate_skips_the_probe(
    small_batch: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "given.json"
    argv = ["bench", "--url", small_batch.url, "--scenario", "overloaded", "--rate", "50",
            "--num-requests", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert "overload" not in report and report["request_rate"] == 50.0
    assert report["completed"] == 4 and "capacity probe" not in capsys.readouterr().err


def refusing_after(served: int) -> FastAPI:
    """A stand-in server that answers its first ``served`` requests, then only 503s."""
    app = FastAPI()
    count = 0

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        nonlocal count
        count += 1
        if count > served:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)

        async def events() -> AsyncIterator[str]:
            yield 'data: {"choices": [{"index": 0, "delta": {"content": " w"}}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_probe_stops_at_the_first_burst_the_server_refuses() -> None:
    one = LengthSpec(1, 1)
    with serve_app(refusing_after(1 + 4)) as url:  # the warm-up, then a burst of 4
        levels = asyncio.run(probe(url, "m", one, one))
    assert [(p.concurrency, p.refused) for p in levels] == [(4, 0), (8, 8)]
    assert plan(levels).capacity_rps == levels[0].requests_per_s
    with serve_app(refusing_after(1 + 2)) as url, pytest.raises(ValueError, match="2 of 4"):
        asyncio.run(probe(url, "m", one, one))
