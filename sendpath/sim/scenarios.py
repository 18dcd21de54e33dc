"""The seed's three situations, and the general form, as simulator runs.

Defaults: Llama-3.1-8B on one H100 (bfloat16), vLLM-like engine settings (256 sequences,
8,192 batched tokens a step), the KV cache sized from what the weights leave of the
memory (90% of it usable).
- ``quiet``: a request every 5 s, short question, 256-token answer: decode dominates.
- ``overloaded``: 60 requests/s of 512 in / 512 out on one GPU whose batch is capped at
  64: far above what it can answer, so requests pile up in the queue.
- ``long-document``: a 100,000-token document (about 300 pages) and a short answer, one
  at a time: prefill takes a visible share (and decode slows, reading that long context).

A GPU's steps are priced by ``gpu_model.GpuStep`` with the efficiency terms fitted to
published engine measurements (``sendpath/sim/gpu_calibration.json``), its weights in the
run's ``precision``; a run far outside what those measurements cover (``coverage.py``) is
refused with ``OutsideCalibration`` unless ``allow_extrapolation``, and the report's
``simulated.calibration`` says what the answer rests on and what was extrapolated. The
2-core ``cpu`` entry is priced by the plain roofline. A run with ``cost_model`` (a `sendpath
profile` file) prices steps with that machine's fitted step times instead, for the model
and device that were profiled; its KV cache is the run's ``config.num_blocks``, not what a
GPU's memory would hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sendpath.bench.report import dominant
from sendpath.bench.workload import LengthSpec
from sendpath.config import SchedulerConfig
from sendpath.sim.calibrated import Calibrated
from sendpath.sim.cost_model import CostModel, Roofline
from sendpath.sim.coverage import OutsideCalibration, coverage
from sendpath.sim.gpu_model import PRECISION_BYTES, GpuStep, calibration
from sendpath.sim.hardware import HARDWARE, Hardware, ModelSpec, hardware, model_spec
from sendpath.sim.simulator import SimConfig, SimResult, Simulator
from sendpath.sim.traffic import Traffic

__all__ = ["SCENARIOS", "Run", "kv_blocks", "simulate"]

MEMORY_USABLE = 0.9
MAX_BLOCKS = 400_000


@dataclass(frozen=True)
class Run:
    traffic: Traffic
    config: SimConfig
    hardware: str = "H100"
    model: str = "llama-3.1-8b"
    tp: int = 1
    gpu_hour_usd: float | None = None
    cost_model: str | None = None  # a `sendpath profile` file: used instead of the roofline
    precision: str = "bf16"  # a GPU's weights: bf16, fp16 or fp8 (the KV cache stays bf16)
    allow_extrapolation: bool = False  # price a GPU run outside the calibration, and say so


SCENARIOS: dict[str, Run] = {
    "quiet": Run(Traffic(rate=0.2, num_requests=20, input_len=LengthSpec(32, 32),
                         output_len=LengthSpec(256, 256)), SimConfig()),
    "overloaded": Run(Traffic(rate=60.0, num_requests=1500, input_len=LengthSpec(512, 512),
                              output_len=LengthSpec(512, 512)),
                      SimConfig(scheduler=SchedulerConfig(max_num_seqs=64,
                                                          max_num_batched_tokens=8192))),
    # a 300-page document: three times the longest prompt a published source ran, so
    # priced on a GPU as an extrapolation, and the answer says so
    "long-document": Run(Traffic(rate=0.02, num_requests=3, input_len=LengthSpec(100_000, 100_000),
                                 output_len=LengthSpec(256, 256)), SimConfig(),
                         allow_extrapolation=True),
}  # fmt: skip


def kv_blocks(
    model: ModelSpec, hw: Hardware, tp: int, block_size: int, precision: str = "bf16"
) -> int:
    """KV blocks (bf16) that fit beside the weights (in ``precision``) on ``tp`` devices."""
    free = hw.memory * tp * MEMORY_USABLE - model.params * PRECISION_BYTES[precision]
    if free <= 0:
        raise ValueError(
            f"{model.name} ({model.params / 1e9:.0f} B parameters) does not fit on {tp} x "
            f"{hw.name}; raise --tp"
        )
    return min(MAX_BLOCKS, int(free // (block_size * model.kv_bytes_per_token)))


def simulate(run: Run) -> tuple[SimResult, dict[str, Any]]:
    """Run it; the report has `sendpath bench`'s keys plus the fleet's cost and use."""
    model, hw = model_spec(run.model), hardware(run.hardware)
    step_cost: CostModel
    calibrated_on = None  # what a GPU's priced steps rest on (coverage.py)
    gpu = run.cost_model is None and hw is not HARDWARE["cpu"]  # priced by GpuStep
    if run.precision not in PRECISION_BYTES:
        raise ValueError(f"precision is one of {', '.join(PRECISION_BYTES)}, not {run.precision!r}")
    if not gpu and run.precision != "bf16":
        raise ValueError(
            "--precision sets a GPU's weights; the cpu roofline and a profiled cost model "
            "price the model as it is"
        )
    if run.cost_model is not None:
        if run.tp != 1:
            raise ValueError("--tp does not apply to a calibrated cost model (one device)")
        calibrated = Calibrated.load(run.cost_model)  # CostModelFileError is a ValueError
        step_cost, config = calibrated, run.config
        hw = _profiled_hardware(calibrated, hw)
        hw_name = f"calibrated: {Path(run.cost_model).name} ({calibrated.device})"
        model_name = calibrated.model_name
    else:
        blocks = kv_blocks(model, hw, run.tp, run.config.block_size, run.precision)
        config = replace(run.config, num_blocks=blocks)
        hw_name, model_name = hw.name, model.name
        if not gpu:
            step_cost = Roofline(model, hw, run.tp)
        else:  # the efficiency terms fitted to published measurements, if they cover it
            cover = coverage()
            outside = cover.outside(run.hardware, model, run.tp, run.precision, run.traffic)
            if outside and not run.allow_extrapolation:
                raise OutsideCalibration(outside, cover)
            step_cost = GpuStep(model, hw, run.tp, run.precision, calibration().efficiency)
            calibrated_on = cover.report(run.precision, outside)
    result = Simulator(config, step_cost).run(run.traffic)
    report = dict(result.report)
    devices = config.replicas * run.tp
    gpu_hours = devices * result.duration / 3600
    price = run.gpu_hour_usd if run.gpu_hour_usd is not None else hw.usd_per_hour
    cost = gpu_hours * price
    out_tokens = report["total_output_tokens"]
    found = dominant(report["stages"])
    report.update(
        dominant_stage=found[0] if found else None,
        simulated={
            "hardware": hw_name,
            "model": model_name,
            "calibration": calibrated_on,
            "replicas": config.replicas,
            "tp": run.tp,
            "policy": config.policy,
            "mode": config.mode,
            "kv_blocks_per_replica": config.num_blocks,
            "utilization": [round(b / result.duration, 4) for b in result.busy],
            "kv_peak_usage": [round(k, 4) for k in result.kv_peak],
            "rejected": result.rejected,
            "rate_limited": result.rate_limited,
            "steps": result.num_steps,
            "gpu_hours": gpu_hours,
            "cost_usd": cost,
            "usd_per_1m_output_tokens": cost / out_tokens * 1e6 if out_tokens else None,
        },
    )
    return result, report


def _profiled_hardware(calibrated: Calibrated, default: Hardware) -> Hardware:
    """The table's entry for the profiled device (for its price), else ``default``."""
    device = calibrated.device.lower()
    if device.startswith("cpu"):
        return HARDWARE["cpu"]
    found = [hw for key, hw in HARDWARE.items() if re.search(rf"\b{key.lower()}\b", device)]
    return found[0] if found else default
