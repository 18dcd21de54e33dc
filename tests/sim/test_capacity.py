"""`sendpath sim plan`: the fewest replicas that meet the SLOs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sendpath.bench.workload import LengthSpec
from sendpath.sim.capacity import plan
from sendpath.sim.scenarios import SCENARIOS
from sendpath.sim.traffic import Traffic

RUN = replace(
    SCENARIOS["overloaded"],
    traffic=Traffic(
        rate=40, num_requests=300, input_len=LengthSpec(512, 512), output_len=LengthSpec(128, 128)
    ),
)


def test_plan_finds_the_smallest_fleet_that_meets_the_slos() -> None:
    found = plan(RUN, slo_ttft_p99_ms=300, slo_tpot_p99_ms=30)
    n = found.replicas
    assert n >= 2 and found.tried[n] and not found.tried[n - 1]  # n meets, n - 1 does not
    assert found.report["p99_ttft_ms"] <= 300 and found.report["p99_tpot_ms"] <= 30
    assert found.report["simulated"]["replicas"] == n
    loose = plan(RUN, slo_ttft_p99_ms=1e9, slo_tpot_p99_ms=1e9)
    assert loose.replicas == 1


def test_a_slo_no_fleet_can_meet_is_said_plainly() -> None:
    with pytest.raises(ValueError, match="one replica is too slow"):
        plan(replace(RUN, traffic=replace(RUN.traffic, num_requests=20)), 1e9, 0.001)
