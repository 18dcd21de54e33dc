"""Capacity planning: the fewest replicas that meet the SLOs, and what that costs.

For a traffic shape and a rate, the simulator is run with 1, 2, 4, ... replicas until
the p99 TTFT and p99 TPOT meet their targets, then the gap is bisected down to the
smallest count that meets them (the p99s only fall as replicas are added, up to noise).
When doubling the replicas no longer lowers a TPOT that misses its target, no fleet
will meet it (a lone request's decode is that slow): the search stops and says so.
The cost per 1M output tokens is that many replicas' GPU-hours at the given price,
over the output tokens they produced at that rate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sendpath.sim.scenarios import Run, simulate

__all__ = ["Plan", "plan"]

MAX_REPLICAS = 4096


@dataclass(frozen=True)
class Plan:
    replicas: int
    report: dict[str, Any]
    tried: dict[int, bool]  # replicas -> met the SLOs


def _meets(report: dict[str, Any], ttft_ms: float, tpot_ms: float) -> bool:
    return bool(
        report["completed"]
        and not report["failed"]
        and report["p99_ttft_ms"] <= ttft_ms
        and report["p99_tpot_ms"] <= tpot_ms
    )


def plan(run: Run, slo_ttft_p99_ms: float, slo_tpot_p99_ms: float) -> Plan:
    """The smallest replica count for ``run``'s traffic that meets both SLOs."""
    tried: dict[int, bool] = {}
    reports: dict[int, dict[str, Any]] = {}

    def attempt(n: int) -> bool:
        if n not in tried:
            _, report = simulate(replace(run, config=replace(run.config, replicas=n)))
            reports[n], tried[n] = report, _meets(report, slo_ttft_p99_ms, slo_tpot_p99_ms)
        return tried[n]

    high = 1
    while not attempt(high):
        tpot = reports[high]["p99_tpot_ms"]
        stuck = (
            high > 1 and tpot > slo_tpot_p99_ms and tpot >= 0.95 * reports[high // 2]["p99_tpot_ms"]
        )
        if high >= MAX_REPLICAS or stuck:
            raise ValueError(
                f"{high} replicas still miss the SLOs (p99 TTFT "
                f"{reports[high]['p99_ttft_ms']:.0f} ms, TPOT {reports[high]['p99_tpot_ms']:.1f}"
                " ms): one replica is too slow for them; loosen them or pick faster hardware"
            )
        high *= 2
    low = high // 2  # misses (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        if attempt(mid):
            high = mid
        else:
            low = mid
    return Plan(high, reports[high], tried)
