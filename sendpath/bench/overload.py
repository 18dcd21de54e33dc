"""The overloaded scenario, sized from what the server can do: probe, then offer twice that.

A fixed rate overloads one machine and idles another (16/s once left a CPU server's batch
of 64 half full, so decode, not the queue, dominated). The probe measures the capacity
first: bursts of ``c`` requests sent at once (c = 4, 8, 16, ... up to ``MAX_PROBE``), each
level's throughput ``c / makespan``; once doubling ``c`` no longer raises it by
``SATURATED`` (more requests only wait, in a queue or in a batch that grows no faster), or
once the server turns some away (a sendpath gateway after 30 s in its queue: a burst of
128 did on a busy 2-core host), the best level's throughput is the capacity ``mu``
(requests/s) and the last fully served level's median latency the service time ``S`` (a
request's time while the server holds more than it can speed up on). One request runs
first, uncounted: a server's first steps can be slow (weights re-laid out, caches filled).

Then requests arrive (Poisson) at ``OVERLOAD`` x ``mu``. Nothing queues until the server
holds what it admits at once, ``D`` (a sendpath gateway says how many it forwards, in
``GET /fleet``; elsewhere the largest probe level stands in): the in-flight count grows by
``(OVERLOAD - 1) * mu`` a second, so that takes ``D / ((OVERLOAD - 1) * mu)`` seconds, and
a request in a full server takes about ``D / mu`` (Little's law), longer than ``S`` when
the batch fills past the probe's last level. After that the backlog grows at the same
rate, so a request arriving ``t`` seconds later waits about ``(OVERLOAD - 1) * t``. The
window is the fill time plus the time that makes the later arrivals' mean wait
``QUEUE_OVER_SERVICE`` service times, with the longest wait kept under ``MAX_WAIT_S`` (a
sendpath gateway refuses requests after 30 s in its queue, ``--queue-timeout``). Where a
request's own time is longer than that allows (a slow or busy machine), the mean wait
cannot exceed it; the plan's ``queue_can_dominate`` and its summary say so (shorter
requests, ``--input-len`` / ``--output-len``, or a smaller batch, help).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sendpath.bench.client import RequestResult
from sendpath.bench.runner import Load, run
from sendpath.bench.workload import LengthSpec, build

__all__ = ["OVERLOAD", "OverloadPlan", "ProbeLevel", "plan", "probe"]

OVERLOAD = 2.0  # offered load / measured capacity
QUEUE_OVER_SERVICE = 2.0  # the mean queue wait aimed at, in service times
MAX_WAIT_S = 20.0  # the longest wait aimed at: under a sendpath gateway's 30 s queue timeout
FIRST_PROBE = 4
MAX_PROBE = 256  # requests at once; a server with more room is measured at this level
SATURATED = 1.15  # doubling the burst must raise the throughput this much to go on
MAX_REQUESTS = 2000  # the backlog (about half of them) stays under a gateway's 1,024 queue
PROBE_SEED = 1_000_003  # probe prompts differ from the run's (no prefix-cache head start)


@dataclass(frozen=True)
class ProbeLevel:
    """One burst of the probe: ``concurrency`` requests sent at once."""

    concurrency: int
    requests_per_s: float
    median_latency_s: float
    refused: int = 0  # requests the server turned away (a full queue, or one timed out)


@dataclass(frozen=True)
class OverloadPlan:
    """What the probe measured and the load sized from it."""

    probe: tuple[ProbeLevel, ...]
    capacity_rps: float  # the best probe level's throughput
    service_s: float  # a request's own time in a full server (the probe's, or admitted / mu)
    offered_rps: float
    window_s: float  # arrivals span about this long
    num_requests: int
    admitted: int  # what the server holds at once before anything queues
    expected_mean_wait_s: float  # from the plan (not measured)

    @property
    def factor(self) -> float:
        return self.offered_rps / self.capacity_rps

    @property
    def queue_can_dominate(self) -> bool:
        """Whether the planned mean wait exceeds a request's service time (a prediction
        from the probe: a server that speeds up past its last level does better)."""
        return self.expected_mean_wait_s > self.service_s

    def report(self) -> dict[str, Any]:
        """The plan as the JSON report's ``overload`` entry."""
        out = asdict(self)
        out["probe"] = [asdict(level) for level in self.probe]
        out["offered_over_capacity"] = round(self.factor, 3)
        out["queue_can_dominate"] = self.queue_can_dominate
        out["summary"] = self.describe()
        return out

    def describe(self) -> str:
        """One line: offered load against capacity, and how the probe found it."""
        levels = ", ".join(
            f"{p.concurrency}: {p.refused} refused" if p.refused else
            f"{p.concurrency}: {p.requests_per_s:.2f}/s"
            for p in self.probe
        )  # fmt: skip
        line = (
            f"offered {self.offered_rps:.2f} requests/s = {self.factor:.1f}x the measured "
            f"capacity of {self.capacity_rps:.2f}/s, {self.num_requests} requests over "
            f"{self.window_s:.0f} s (probe, requests at once: {levels}; the server holds "
            f"{self.admitted} at once, each for about {self.service_s:.1f} s; expected mean "
            f"queue wait {self.expected_mean_wait_s:.1f} s)"
        )
        if not self.queue_can_dominate:
            line += (
                f". A request's own time in a full server (about {self.service_s:.1f} s, from "
                f"the probe) is longer than the mean wait a queue may build before a "
                f"gateway's 30 s timeout, so the queue may not dominate here: shorter requests "
                f"(--input-len, --output-len) or a smaller batch make it surer"
            )
        return line


def plan(
    levels: list[ProbeLevel], num_requests: int | None = None, admitted: int | None = None
) -> OverloadPlan:
    """The overload for these probe results (``num_requests``: a fixed count instead;
    ``admitted``: what the server takes at once before anything queues, where it says)."""
    served = [p for p in levels if not p.refused]
    if not served:
        raise ValueError("the capacity probe measured nothing")
    mu = max(p.requests_per_s for p in served)
    depth = max(admitted or 0, served[-1].concurrency)
    service = max(served[-1].median_latency_s, depth / mu)  # a request in a full server
    offered = OVERLOAD * mu
    fill = depth / ((OVERLOAD - 1) * mu)  # until the server holds `depth`, nothing waits
    queueing = min(2 * QUEUE_OVER_SERVICE * service, MAX_WAIT_S) / (OVERLOAD - 1)
    n = num_requests or min(MAX_REQUESTS, max(2, math.ceil(offered * (fill + queueing))))
    window = n / offered
    after = max(0.0, window - fill)
    mean_wait = (OVERLOAD - 1) * after * after / (2 * window)  # over every arrival
    return OverloadPlan(tuple(levels), mu, service, offered, window, n, depth, mean_wait)


async def probe(
    url: str,
    model: str,
    input_len: LengthSpec,
    output_len: LengthSpec,
    api_key: str | None = None,
    extra: dict[str, object] | None = None,
    on_level: Callable[[ProbeLevel], None] = lambda p: None,
) -> list[ProbeLevel]:
    """Bursts of 4, 8, 16, ... requests at once until the throughput stops rising or the
    server refuses some (after one uncounted request). Raises ValueError when the first
    burst already fails."""
    warm_up = build("random", 1, input_len, output_len, PROBE_SEED)
    results, _ = await run(url, model, warm_up, Load(concurrency=1), api_key, extra)
    _check(results)
    levels: list[ProbeLevel] = []
    c = FIRST_PROBE
    while c <= MAX_PROBE:
        burst = build("random", c, input_len, output_len, PROBE_SEED + c)
        results, duration = await run(url, model, burst, Load(concurrency=c), api_key, extra)
        refused = sum(1 for r in results if not r.success)
        if refused and not levels:
            _check(results)
        level = ProbeLevel(
            c, c / max(duration, 1e-9), statistics.median(r.latency for r in results), refused
        )
        on_level(level)
        if refused:  # saturated past doubt: it turns requests away
            levels.append(level)
            break
        best = max((p.requests_per_s for p in levels), default=0.0)
        levels.append(level)
        if best and level.requests_per_s < SATURATED * best:
            break
        c *= 2
    return levels


def _check(results: list[RequestResult]) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        raise ValueError(
            f"the capacity probe's {len(failed)} of {len(results)} requests failed: "
            f"{failed[0].error}"
        )
