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

``Calibrated`` (``calibrated.py``): a linear model fitted to step times measured on the
real engine (`sendpath profile`).
"""

from __future__ import annotations

from typing import Protocol

from sendpath.engine.steps import StepShape
from sendpath.sim.hardware import Hardware, ModelSpec

__all__ = ["COMPUTE_EFF", "MEMORY_EFF", "CostModel", "Roofline", "StepShape"]

COMPUTE_EFF = 0.5
MEMORY_EFF = 0.8


class CostModel(Protocol):
    """Seconds one engine step of this shape takes."""

    def step_seconds(self, shape: StepShape) -> float: ...


class Roofline:
    """Roofline step time of ``model`` on ``tp`` devices of ``hw``."""

    def __init__(self, model: ModelSpec, hw: Hardware, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
        self.model, self.hw, self.tp = model, hw, tp
        self.weight_bytes = model.params * model.bytes_per_param
        # per unit of each shape field, in seconds (the simulator prices millions of steps)
        compute, memory = hw.flops * tp * COMPUTE_EFF, hw.bandwidth * tp * MEMORY_EFF
        self._token_flops_s = 2 * model.params / compute
        self._context_flops_s = 4 * model.layers * model.hidden / compute
        self._weights_s = self.weight_bytes / memory
        self._kv_s = model.kv_bytes_per_token / memory
        self._allreduce_s = 0.0
        if tp > 1 and hw.link_bandwidth > 0:
            # two all-reduces of the activations per layer, ring: 2 (tp-1)/tp of the data
            volume = 2 * model.layers * model.hidden * model.bytes_per_param
            self._allreduce_s = volume * 2 * (tp - 1) / tp / hw.link_bandwidth

    def step_seconds(self, shape: StepShape) -> float:
        tokens = shape.num_tokens
        if tokens == 0:
            return self.hw.step_overhead_s
        compute_s = self._token_flops_s * tokens + self._context_flops_s * shape.context_tokens
        memory_s = self._weights_s + self._kv_s * (shape.kv_tokens + tokens)
        slower = compute_s if compute_s > memory_s else memory_s
        return slower + self._allreduce_s * tokens + self.hw.step_overhead_s

    def decode_steps(self, batch: int, context: int, steps: int) -> list[float]:
        """``step_seconds`` of ``steps`` decode steps of ``batch`` sequences whose contexts
        add up to ``context`` before the first, to the last bit (the fleet mode's bulk)."""
        out = []
        tf, cf, w, kv = self._token_flops_s, self._context_flops_s, self._weights_s, self._kv_s
        allreduce, overhead = self._allreduce_s * batch, self.hw.step_overhead_s
        for _ in range(steps):
            context += batch
            compute_s = tf * batch + cf * context
            memory_s = w + kv * (context + batch)
            out.append((compute_s if compute_s > memory_s else memory_s) + allreduce + overhead)
        return out
