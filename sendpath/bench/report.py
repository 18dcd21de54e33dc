"""The numbers of a benchmark run, with `vllm bench serve`'s names and definitions.

TTFT: sending to the first text chunk. TPOT per request: ``(latency - ttft) / (output
tokens - 1)``. ITL: every gap between text chunks, pooled over requests. E2EL: sending to
the last byte. Throughputs divide by the run's duration (first send to last answer).
Goodput: requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el`` in ms).
``stages``: the mean milliseconds of each stage the server reported in its ``timings``
(plus ``network``, measured here) and its share of the mean E2EL.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sendpath.bench.client import RequestResult

__all__ = ["GOODPUT_METRICS", "NOT_STAGES", "dominant", "summarize"]

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
NOT_STAGES = ("ttft", "total")  # timings keys that are not stages


def _stats(
    name: str, values_s: Sequence[float] | NDArray[np.float64], percentiles: list[float]
) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000
    if not ms.size:
        ms = np.zeros(1)
    # the median and the percentiles from one partial sort (a million ITLs or more)
    cuts = np.percentile(ms, [50.0, *percentiles])
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(cuts[0]),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p, cut in zip(percentiles, cuts[1:], strict=True):
        out[f"p{p:g}_{name}_ms"] = float(cut)
    return out


def tpot(r: RequestResult) -> float | None:
    if r.ttft is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99.0,),
) -> dict[str, Any]:
    """The report: vLLM's keys, then ``stages``."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    pct = list(percentiles)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None], pct),
        **_stats("tpot", tpots, pct),
        **_stats("itl", _pooled_itl(ok), pct),
        **_stats("e2el", [r.latency for r in ok], pct),
    }
    if goodput_slos_ms:
        good = sum(1 for r in ok if _meets(r, goodput_slos_ms))
        out["request_goodput"] = good / duration
    out["errors"] = sorted({r.error for r in results if r.error})[:5]
    out["stages"] = stage_shares(ok)
    return out


def _pooled_itl(ok: list[RequestResult]) -> NDArray[np.float64]:
    """Every request's inter-token gaps, in one array (the simulator keeps them as
    arrays: a million requests' gaps never become float objects)."""
    gaps = array("d")
    for r in ok:  # an array joins with a memcpy; a client's list is converted
        gaps += r.itl if isinstance(r.itl, array) else array("d", r.itl)
    return np.frombuffer(gaps) if gaps else np.zeros(0)


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}
    for name, limit in slos.items():
        v = values[name]
        if v is not None and v * 1000 > limit:
            return False
    return True


def stage_shares(ok: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Mean ms and share of the mean E2EL for each reported stage, and ``network``."""
    timed = [r for r in ok if r.timings]
    if not timed:
        return {}
    keys = dict.fromkeys(itertools.chain.from_iterable(r.timings for r in timed))
    names = [n for n in keys if n not in NOT_STAGES]
    # fsum / n is statistics.fmean without its per-item counting (a million results)
    e2el_ms = math.fsum(r.latency * 1000 for r in timed) / len(timed)
    dicts = [r.timings for r in timed]
    sums = []
    for name in names:  # a stage one result did not report counts as 0 there
        try:  # a million results: a C loop
            sums.append(math.fsum(map(operator.itemgetter(name), dicts)))
        except KeyError:
            sums.append(math.fsum(d.get(name, 0.0) for d in dicts))
    means = {n: total / len(timed) for n, total in zip(names, sums, strict=True)}
    networks = [n for r in timed if (n := r.network_ms) is not None]
    if networks:
        means["network"] = statistics.fmean(networks)
    return {
        n: {"mean_ms": round(v, 3), "share": round(v / e2el_ms, 4) if e2el_ms else 0.0}
        for n, v in means.items()
    }


# What a dominant stage means, in the seed's words.
_GROUPS = {
    "queue": ("gateway.queue", "engine.queue"),
    "prefill": ("prefill", "tokenize"),
    "decode": ("decode",),
}
_WHY = {
    "queue": "requests waited for a slot: more arrived than the replicas could take at once",
    "prefill": "the prompts are long: computing them, even in one parallel pass, took a "
    "large share",
    "decode": "answers come one token per step: long answers, or a big batch that slows "
    "every step, make decoding the bulk of the wait",
}


def dominant(stages: dict[str, dict[str, float]]) -> tuple[str, float, str] | None:
    """The group of stages (queue, prefill, decode, other) with the largest share, its
    share, and why, in plain words."""
    if not stages:
        return None
    shares = {g: sum(stages.get(s, {}).get("share", 0.0) for s in names)
              for g, names in _GROUPS.items()}  # fmt: skip
    grouped = {s for names in _GROUPS.values() for s in names}
    shares["other"] = sum(v["share"] for s, v in stages.items() if s not in grouped)
    group = max(shares, key=lambda g: shares[g])
    why = _WHY.get(group, "gateway, routing and network overheads dominate")
    return group, shares[group], why
