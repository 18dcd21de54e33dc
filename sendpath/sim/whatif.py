"""The page's "what if" panel: a small simulator run from four sliders."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sendpath.bench.workload import LengthSpec
from sendpath.errors import InvalidRequestError
from sendpath.sim.hardware import hardware, model_spec
from sendpath.sim.scenarios import SCENARIOS, kv_blocks, simulate
from sendpath.sim.traffic import Traffic

__all__ = ["what_if"]

LIMITS = {"rate": (0.01, 1000.0), "prompt": (1, 120_000), "answer": (1, 8192), "replicas": (1, 64)}
# One run is bounded whatever the sliders say (a few seconds of one core at most): at most
# MAX_REQUESTS requests, MAX_TOKENS prompt and answer tokens and MAX_DECODES answer tokens
# in all, and about MAX_STEPS engine steps per replica (requests that cannot all fit in
# the KV cache at once run in waves, each as many steps as an answer is long).
MAX_REQUESTS = 200
MAX_TOKENS = 2_000_000
MAX_DECODES = 300_000
MAX_STEPS = 10_000


def what_if(rate: float, prompt: int, answer: int, replicas: int) -> dict[str, Any]:
    """Stage shares and latencies for ``rate`` requests/s of ``prompt`` in / ``answer`` out
    on ``replicas`` H100s serving Llama-3.1-8B (batches of up to 64 sequences)."""
    for name, value in (("rate", rate), ("prompt", prompt), ("answer", answer),
                        ("replicas", replicas)):  # fmt: skip
        low, high = LIMITS[name]
        if not low <= value <= high:
            raise InvalidRequestError(f"{name} must be within {low}..{high}, got {value}")
    base = SCENARIOS["overloaded"]  # Llama-3.1-8B, one H100, batches of up to 64
    sched = base.config.scheduler
    kv_tokens = kv_blocks(model_spec(base.model), hardware(base.hardware), base.tp, 16) * 16
    at_once = max(1, min(sched.max_num_seqs, kv_tokens // (prompt + answer))) * replicas
    steps_each = answer + prompt / sched.max_num_batched_tokens
    # enough requests to reach a steady state, few enough to answer at once
    count = max(
        1,
        int(
            min(
                MAX_REQUESTS,
                max(8, rate * 60),
                MAX_TOKENS // (prompt + answer),
                MAX_DECODES // answer,
                at_once * MAX_STEPS / steps_each,
            )
        ),
    )
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
