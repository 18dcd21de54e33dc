"""Step-cost models: how long one engine step takes, from the step's plan.

``Roofline``: a step reads the weights once and every scheduled token's KV context, and
does ``2 x params`` FLOPs per token plus attention over its context; it takes the longer
of compute time and memory time at stated efficiencies, plus a per-step overhead:

    flops = 2 * params * tokens + 4 * layers * hidden * sum(context attended per token)
    bytes = weight bytes + KV bytes read (context) + KV bytes written (new tokens)
    step  = max(flops / (peak * COMPUTE_EFF), bytes / (bandwidth * MEMORY_EFF))
            + tensor-parallel all-reduces + overhead

Efficiencies are assumptions, stated here: large prefill GEMMs on H100-class parts reach
about half of peak in serving engines (``COMPUTE_EFF`` 0.5), and decode's weight
streaming about 80% of memory bandwidth (``MEMORY_EFF`` 0.8). Decode is memory-bound, so
its step time scales with 1/bandwidth (H200 vs H100: 1/1.43); prefill is compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sendpath.engine.scheduler import SchedulerOutput
from sendpath.sim.hardware import Hardware, ModelSpec

__all__ = ["COMPUTE_EFF", "MEMORY_EFF", "CostModel", "Roofline", "StepShape"]

COMPUTE_EFF = 0.5
MEMORY_EFF = 0.8


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: tokens computed, and the context each one reads."""

    num_tokens: int
    num_seqs: int
    context_tokens: int  # sum over computed tokens of the positions they attend to
    kv_tokens: int  # sum over sequences of the KV they read once (their whole context)

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepShape:
        tokens = context = kv = 0
        for item in plan.requests:
            n, start = item.num_tokens, item.start_pos
            tokens += n
            context += n * start + n * (n + 1) // 2
            kv += start + n
        return cls(tokens, len(plan.requests), context, kv)


class CostModel(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


class Roofline:
    """Roofline step time of ``model`` on ``tp`` devices of ``hw``."""

    def __init__(self, model: ModelSpec, hw: Hardware, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
        self.model, self.hw, self.tp = model, hw, tp
        self.weight_bytes = model.params * model.bytes_per_param

    def step_seconds(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return self.hw.step_overhead_s
        m = self.model
        flops = 2 * m.params * shape.num_tokens + 4 * m.layers * m.hidden * shape.context_tokens
        memory = self.weight_bytes + m.kv_bytes_per_token * (shape.kv_tokens + shape.num_tokens)
        compute_s = flops / (self.hw.flops * self.tp * COMPUTE_EFF)
        memory_s = memory / (self.hw.bandwidth * self.tp * MEMORY_EFF)
        allreduce_s = 0.0
        if self.tp > 1 and self.hw.link_bandwidth > 0:
            # two all-reduces of the activations per layer, ring: 2 (tp-1)/tp of the data
            volume = 2 * m.layers * shape.num_tokens * m.hidden * m.bytes_per_param
            allreduce_s = volume * 2 * (self.tp - 1) / self.tp / self.hw.link_bandwidth
        return max(compute_s, memory_s) + allreduce_s + self.hw.step_overhead_s
