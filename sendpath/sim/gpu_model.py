"""A GPU step's time with efficiency terms: what a serving engine reaches of the datasheet.

``Roofline`` (``cost_model.py``) prices a step at fixed shares of the peaks. Real engines
reach a share that depends on the step: a decode of a few sequences streams the weights
at most of the bandwidth, a prefill of a few hundred tokens is too small to fill the
tensor cores, and every step pays its scheduling, launches and sampling. Here, for a step
of T tokens (prompt chunks and decodes) over S sequences:

    compute = 2 params T / (peak(precision) tp eff(T)) + attention FLOPs / (bf16 peak tp compute)
    eff(T)  = compute T / (T + half_tokens)          (half of ``compute`` at ``half_tokens``)
    memory  = (weights + KV read and written) / (bandwidth tp memory)
    step    = max(compute, memory) + tp all-reduces + step_s + seq_s S

The attention FLOPs are 4 layers d_attn per (token, position attended) pair; the KV read is
each sequence's whole context once (``StepShape.kv_tokens``). Tensor parallelism splits
FLOPs and bytes over ``tp`` devices and adds two all-reduces a layer of the step's
activations over the link (ring: 2 (tp - 1) / tp of the data, plus a latency each).
``precision`` is the weights': bf16 (2 bytes a parameter, the bf16 peak) or fp8 (1 byte,
the fp8 peak, where the GPU has one); the KV cache and attention stay bf16.

The terms' values (``Efficiency``) are fitted to published measurements
(``gpu_sources.py``, ``benchmarks/gpu_calibration.py``); the defaults are the roofline's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from sendpath.engine.steps import StepShape
from sendpath.sim.hardware import Hardware, ModelSpec

__all__ = ["CALIBRATION", "PRECISION_BYTES", "Calibration", "Efficiency", "GpuStep", "calibration"]

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
CALIBRATION = Path(__file__).parent / "gpu_calibration.json"  # benchmarks/gpu_calibration.py


@dataclass(frozen=True)
class Efficiency:
    """The shares of the peaks an engine reaches, and what each step and sequence costs."""

    compute: float = 0.5  # of peak FLOP/s, for steps of many tokens
    half_tokens: float = 0.0  # tokens a step at which it reaches half of ``compute``
    memory: float = 0.8  # of peak bandwidth, reading weights and KV
    step_s: float = 0.001  # every step: scheduling, kernel launches, sampling
    seq_s: float = 0.0  # every sequence in a step (its host-side bookkeeping)
    link_latency_s: float = 0.0  # each all-reduce's fixed cost (tp > 1)

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1 and 0 < self.memory <= 1):
            raise ValueError("compute and memory efficiencies are shares in (0, 1]")
        if min(self.half_tokens, self.step_s, self.seq_s, self.link_latency_s) < 0:
            raise ValueError("half_tokens, step_s, seq_s and link_latency_s must be >= 0")


class GpuStep:
    """``model`` on ``tp`` devices of ``hw``, its weights in ``precision``."""

    def __init__(
        self,
        model: ModelSpec,
        hw: Hardware,
        tp: int = 1,
        precision: str = "bf16",
        efficiency: Efficiency | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
        if precision not in PRECISION_BYTES:
            raise ValueError(f"precision is one of {', '.join(PRECISION_BYTES)}, not {precision!r}")
        peak = hw.fp8_flops if precision == "fp8" else hw.flops
        if peak <= 0:
            raise ValueError(f"{hw.name} has no {precision} tensor cores")
        if tp > 1 and hw.link_bandwidth <= 0:
            raise ValueError(f"{hw.name} has no link between devices for tensor parallelism")
        self.model, self.hw, self.tp, self.precision = model, hw, tp, precision
        self.eff = eff = efficiency or Efficiency()
        kv = replace(model, bytes_per_param=2)  # the cache stays bfloat16
        self.weight_bytes = model.params * PRECISION_BYTES[precision]
        self._linear_s = 2 * model.params / (peak * tp * eff.compute)  # a token, at full eff
        attn_dim = model.heads * model.head_dim
        self._attention_s = 4 * model.layers * attn_dim / (hw.flops * tp * eff.compute)
        memory = hw.bandwidth * tp * eff.memory
        self._weights_s = self.weight_bytes / memory
        self._kv_s = kv.kv_bytes_per_token / memory
        self._allreduce_s = self._allreduce_token_s = 0.0
        if tp > 1:  # two all-reduces a layer of each token's activations
            data = 2 * model.hidden * 2 * (tp - 1) / tp  # bf16 activations, ring
            self._allreduce_token_s = 2 * model.layers * data / hw.link_bandwidth
            self._allreduce_s = 2 * model.layers * eff.link_latency_s

    def step_seconds(self, shape: StepShape) -> float:
        tokens = shape.num_tokens
        eff = self.eff
        if tokens == 0:
            return eff.step_s
        fill = tokens / (tokens + eff.half_tokens)  # of the compute efficiency reached
        compute_s = self._linear_s * tokens / fill + self._attention_s * shape.context_tokens
        memory_s = self._weights_s + self._kv_s * (shape.kv_tokens + tokens)
        slower = compute_s if compute_s > memory_s else memory_s
        allreduce = self._allreduce_s + self._allreduce_token_s * tokens
        return slower + allreduce + eff.step_s + eff.seq_s * shape.num_seqs

    def decode_steps(self, batch: int, context: int, steps: int) -> list[float]:
        """``step_seconds`` of ``steps`` decode steps of ``batch`` sequences whose contexts
        add up to ``context`` before the first (the fleet mode's bulk pricing)."""
        out = []
        for _ in range(steps):
            context += batch
            out.append(self.step_seconds(StepShape(batch, batch, context, context)))
        return out


@dataclass(frozen=True)
class Calibration:
    """The efficiency terms fitted to published measurements, and what they rest on."""

    efficiency: Efficiency
    sources: dict[str, str]  # file name -> citation
    fitted_on: tuple[str, ...]
    held_out: tuple[str, ...]
    held_out_error: dict[str, Any]  # kind of figure -> count, mean and max error (bf16/fp16)
    models: tuple[str, ...]
    gpus: tuple[str, ...]
    held_out_error_fp8: dict[str, Any] = field(default_factory=dict)  # fp8: held out, not fit
    fit_precisions: tuple[str, ...] = ()  # the weights' precisions the fit took as one

    def error_for(self, precision: str) -> dict[str, Any]:
        """The held-out error by kind of figure that applies to weights in ``precision``."""
        return self.held_out_error_fp8 if precision == "fp8" else self.held_out_error


@cache
def calibration(path: Path = CALIBRATION) -> Calibration:
    """The fitted terms ``benchmarks/gpu_calibration.py`` wrote."""
    data = json.loads(path.read_text())
    return Calibration(
        Efficiency(**data["efficiency"]),
        dict(data["sources"]),
        tuple(data["fitted_on"]),
        tuple(data["held_out"]),
        dict(data["held_out_error"]),
        tuple(data["models"]),
        tuple(data["gpus"]),
        dict(data.get("held_out_error_fp8", {})),
        tuple(p for p in data.get("fit_precisions", "").split(",") if p),
    )
