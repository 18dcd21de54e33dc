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
    times = array("d", request.timeline.token_times)
    if not bulks:
        return np.frombuffer(times)
    # each part is in order; they are in order together unless the timeline recorded
    # tokens between two bulks (a step with everyone unparked)
    first = next((bulk[0] for bulk in bulks if bulk), None)
    ordered = not times or first is None or times[-1] <= first
    for bulk in bulks:
        times += bulk
    out = np.frombuffer(times)
    if not ordered:
        out = np.sort(out)
    return out


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
    timings = _gateway_timings(config)
    for stage, key in _ENGINE_STAGES:
        timings[key] = stages.get(stage, 0.0) * 1000
    timings[_STREAM] = 0.0
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
        itl=array("d", (seen[1:] - seen[:-1]).tobytes()) if keep_itl else [],
        latency=end - sent,
        start=sent,
        finish_reason="length",
        timings=timings,
    )


# the stages' keys as plain strings (an enum's .value is a Python-level lookup)
_ENGINE_STAGES = tuple(
    (s, s.value) for s in (Stage.TOKENIZE, Stage.ENGINE_QUEUE, Stage.PREFILL, Stage.DECODE)
)
_STREAM = Stage.STREAM.value


_GATEWAY = tuple(
    s.value
    for s in (
        Stage.GATEWAY_AUTH,
        Stage.GATEWAY_RATELIMIT,
        Stage.GATEWAY_SAFETY,
        Stage.GATEWAY_QUEUE,
        Stage.ROUTE,
    )
)


def _gateway_timings(config: SimConfig) -> dict[str, float]:
    """A new timings dict holding the gateway's stages (fixed by ``config``), in order."""
    ms = (config.gateway_auth_s * 1000, config.gateway_ratelimit_s * 1000,
          config.gateway_safety_s * 1000, 0.0, config.route_s * 1000)  # fmt: skip
    return dict(zip(_GATEWAY, ms, strict=True))
