"""A finished simulated request as a client would have measured it (network and gateway
latencies added), with the stages the server would have reported: the same
``RequestResult`` that `sendpath bench` makes, so `sendpath sim` reports with the same keys
and definitions. Past ``ITL_SAMPLE`` requests, inter-token gaps are kept for an even sample
of them (every n-th), which is what the ITL percentiles read. Where the output filter
holds a stream's first token (``SimConfig.first_token_hold``, or a replayed request's own
``held``), the client sees it with the next ones, as one event: its time to first token
is theirs."""

from __future__ import annotations

import bisect
import hashlib
import itertools
from array import array

import numpy as np
from numpy.typing import NDArray

from sendpath.bench.client import RequestResult
from sendpath.request import Request
from sendpath.sim.config import SimConfig
from sendpath.trace import Stage

__all__ = ["client_view", "held_tokens", "token_times"]


def token_times(request: Request, bulks: list[array[float]] | None) -> NDArray[np.float64]:
    """The request's token times, in order: those its timeline recorded, and its
    fleet-mode bulks'."""
    times = np.array(request.timeline.token_times, dtype=np.float64)
    if bulks:
        times = np.concatenate([times, *map(np.frombuffer, bulks)])
        times.sort()
    return times


def held_tokens(request_id: str, shares: tuple[float, ...]) -> int:
    """How many more tokens the output filter waits for before it lets a request's first
    one out: drawn from ``shares`` by a hash of the id (the same in both modes and
    whatever order requests finish in)."""
    if not shares:
        return 0
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    u = int.from_bytes(digest) / 2**64  # even for ids that differ in a digit (crc32 is not)
    return min(bisect.bisect_right(list(itertools.accumulate(shares)), u), len(shares) - 1)


def client_view(
    request: Request,
    sent: float,
    config: SimConfig,
    tokens: NDArray[np.float64],
    keep_itl: bool,
    held: int | None = None,
) -> RequestResult:
    """``tokens``: the request's token times; ``keep_itl``: keep its inter-token gaps;
    ``held``: the output filter's hold on its first token, if known (else drawn)."""
    tl = request.timeline
    half = config.network_rtt_s / 2
    stages = tl.stages()
    timings = {
        Stage.GATEWAY_AUTH.value: config.gateway_auth_s * 1000,
        Stage.GATEWAY_RATELIMIT.value: config.gateway_ratelimit_s * 1000,
        Stage.GATEWAY_SAFETY.value: config.gateway_safety_s * 1000,
        Stage.GATEWAY_QUEUE.value: 0.0,
        Stage.ROUTE.value: config.route_s * 1000,
    }
    for stage in (Stage.TOKENIZE, Stage.ENGINE_QUEUE, Stage.PREFILL, Stage.DECODE):
        timings[stage.value] = stages.get(stage, 0.0) * 1000
    timings[Stage.STREAM.value] = 0.0
    end = (tl.end or float(tokens[-1])) + half
    if held is None:
        held = held_tokens(request.request_id, config.first_token_hold)
    held = min(held, len(tokens) - 1)
    seen = tokens[held:] if held else tokens  # what reached the client as its own event
    timings["total"] = sum(timings.values())  # the server's part; network is the rest
    return RequestResult(
        success=True,
        request_id=request.request_id,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=len(request.output_token_ids),
        ttft=float(seen[0]) + half - sent,
        itl=array("d", np.diff(seen).tobytes()) if keep_itl else [],
        latency=end - sent,
        start=sent,
        finish_reason="length",
        timings=timings,
    )
