"""The overloaded scenario: a capacity probe, then twice that load, against a real server
(a replica of the tiny model whose batch holds 2 sequences, behind a gateway)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sendpath.bench.overload import MAX_WAIT_S, OVERLOAD, ProbeLevel, plan
from sendpath.cli import main
from sendpath.model.loader import LoadedModel
from tests.gateway.conftest import gateway
from tests.server.conftest import Server, serve


@pytest.fixture(scope="module")
def small_batch(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny, max_num_seqs=2) as s:
        yield s


def test_plan_offers_twice_the_best_level_for_a_queue_of_two_service_times() -> None:
    levels = [ProbeLevel(4, 2.0, 1.5), ProbeLevel(8, 4.0, 2.0), ProbeLevel(16, 3.9, 4.1)]
    p = plan(levels)
    # capacity: the best level; service time: the last (saturated) level's latency
    assert OVERLOAD == 2.0 and p.capacity_rps == 4.0 and p.service_s == 4.1
    # mean wait = 2 x 4.1 s -> window 16.4 s -> 8/s x 16.4 s = 131.2 -> 132 requests
    assert p.offered_rps == pytest.approx(8.0) and p.num_requests == 132
    assert p.window_s == pytest.approx(132 / 8.0)
    assert p.expected_mean_wait_s == pytest.approx(p.window_s / 2)
    assert p.queue_can_dominate and "cannot dominate" not in p.describe()
    # a slow server: the longest wait stays under the cap, so fewer requests, and a mean
    # wait (10 s) shorter than the service time (30 s), which the summary says
    slow = plan([ProbeLevel(64, 2.0, 30.0)])
    assert slow.num_requests == 4 * MAX_WAIT_S and slow.window_s == MAX_WAIT_S
    assert not slow.queue_can_dominate and "the queue cannot dominate here" in slow.describe()
    assert slow.report()["queue_can_dominate"] is False
    assert plan(levels, num_requests=10).num_requests == 10
    assert "8.00 requests/s = 2.0x the measured capacity of 4.00/s" in p.describe()
    with pytest.raises(ValueError, match="measured nothing"):
        plan([])


def test_overloaded_scenario_probes_then_offers_twice_the_capacity(
    small_batch: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overloaded.json"
    with gateway(small_batch, tmp_path / "gw") as gw:
        argv = ["bench", "--url", gw.url, "--api-key", gw.key("bench"),
                "--scenario", "overloaded", "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    overload = report["overload"]
    probed = [level["concurrency"] for level in overload["probe"]]
    assert probed[:2] == [4, 8] and probed == [4 * 2**i for i in range(len(probed))]
    assert overload["capacity_rps"] == max(lv["requests_per_s"] for lv in overload["probe"])
    assert overload["offered_rps"] == pytest.approx(2 * overload["capacity_rps"])
    assert overload["offered_over_capacity"] == 2.0
    assert report["request_rate"] == overload["offered_rps"]
    assert report["completed"] == overload["num_requests"] and report["failed"] == 0
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
