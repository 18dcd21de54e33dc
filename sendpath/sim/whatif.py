"""The page's "what if" panel: a small simulator run from four sliders."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sendpath.bench.workload import LengthSpec
from sendpath.errors import InvalidRequestError
from sendpath.sim.scenarios import SCENARIOS, simulate
from sendpath.sim.traffic import Traffic

__all__ = ["what_if"]

MAX_REQUESTS = 200
LIMITS = {"rate": (0.01, 1000.0), "prompt": (1, 120_000), "answer": (1, 8192), "replicas": (1, 64)}


def what_if(rate: float, prompt: int, answer: int, replicas: int) -> dict[str, Any]:
    """Stage shares and latencies for ``rate`` requests/s of ``prompt`` in / ``answer`` out
    on ``replicas`` H100s serving Llama-3.1-8B (batches of up to 64 sequences)."""
    for name, value in (("rate", rate), ("prompt", prompt), ("answer", answer),
                        ("replicas", replicas)):  # fmt: skip
        low, high = LIMITS[name]
        if not low <= value <= high:
            raise InvalidRequestError(f"{name} must be within {low}..{high}, got {value}")
    # enough requests to reach a steady state, few enough to answer at once
    count = int(min(MAX_REQUESTS, max(8, rate * 60)))
    base = SCENARIOS["overloaded"]  # Llama-3.1-8B, one H100, batches of up to 64
    run = replace(
        base,
        traffic=Traffic(rate, count, LengthSpec(prompt, prompt), LengthSpec(answer, answer)),
        config=replace(base.config, replicas=replicas, policy="least_load"),
    )
    _, report = simulate(run)
    s = report["simulated"]
    return {
        "requests": count,
        "hardware": s["hardware"],
        "model": s["model"],
        "stages": report["stages"],
        "dominant_stage": report["dominant_stage"],
        "median_ttft_ms": report["median_ttft_ms"],
        "median_e2el_ms": report["median_e2el_ms"],
        "utilization": s["utilization"],
        "usd_per_1m_output_tokens": s["usd_per_1m_output_tokens"],
    }
