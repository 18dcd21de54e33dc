"""The GPU step model's efficiency terms fitted to published measurements, and its error
on the ones held out (issue 43).

Each published measurement (``gpu_sources.py``) is replayed by the simulator: the source's
model and GPU, its tensor parallelism and replica count, its engine's batch limits where
known (stated by the source, or the engine's own cited default: ``gpu_sources.py``; else
vLLM's: 256 sequences, 8,192 tokens a step, ``ASSUMED_LIMITS``), its lengths, and its
load (Poisson arrivals at its request rate, every request at once, or a closed loop of its
concurrency: ten rounds where the number of prompts is not stated; offline with a stated
concurrency and no count: one batch of that many), with no network,
gateway or routing cost, since an engine benchmark has none. The simulator's report gives
the same figures the source printed; the error of one is |predicted - published| /
published. ``fit`` picks the ``Efficiency`` with the least mean error over the training
figures by coordinate search over fixed grids, so the same sources always give the same
terms. A measurement the simulator cannot replay (a dataset without stated lengths, a
model or GPU it does not know) is listed with the reason, never guessed. A replay runs
at most ``MAX_REQUESTS`` requests.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from sendpath.bench.workload import LengthSpec
from sendpath.config import SchedulerConfig
from sendpath.sim.config import SimConfig
from sendpath.sim.gpu_model import PRECISION_BYTES, Efficiency, GpuStep
from sendpath.sim.gpu_sources import LIMITS, Measurement, Source
from sendpath.sim.hardware import Hardware, ModelSpec, hardware, model_spec
from sendpath.sim.simulator import Simulator
from sendpath.sim.traffic import Traffic

__all__ = [
    "ASSUMED_LIMITS",
    "GRID",
    "Case",
    "Mapper",
    "Unreplayable",
    "case_error",
    "cases",
    "fit",
    "mean_error",
    "predict",
]

ASSUMED_LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}  # where not known
OFFLINE_RATE = 1e6  # requests/s: every request at once
MAX_REQUESTS = 1000  # a replay's requests at most (published runs: 200-1,000)
REPORT_KEYS = {  # a published figure -> the simulator's report key (and its scale)
    "output_throughput_tok_s": ("output_throughput", 1.0),
    "total_throughput_tok_s": ("total_token_throughput", 1.0),
    "request_throughput_req_s": ("request_throughput", 1.0),
    "ttft_p50_ms": ("median_ttft_ms", 1.0),
    "ttft_mean_ms": ("mean_ttft_ms", 1.0),
    "ttft_p99_ms": ("p99_ttft_ms", 1.0),
    "tpot_p50_ms": ("median_tpot_ms", 1.0),
    "tpot_mean_ms": ("mean_tpot_ms", 1.0),
    "tpot_p99_ms": ("p99_tpot_ms", 1.0),
    "itl_p50_ms": ("median_itl_ms", 1.0),
    "itl_mean_ms": ("mean_itl_ms", 1.0),
    "e2e_p50_s": ("median_e2el_ms", 1e-3),
}
# The terms' grids for the coordinate search, which starts from ``Efficiency()``'s defaults
# and takes them in this order. The all-reduce latency, which only tensor-parallel steps
# pay, comes before the cost every step pays: searched the other way round (on coarser
# grids), the first sweep gave every step the tp sources' extra cost, 3 ms, and one term
# at a time could not trade it back for the all-reduces' (a local minimum: 14.0% mean
# error on the fitted figures at 3 ms and 30 us, against 13.0% at 1 ms and 40 us).
GRID: dict[str, tuple[float, ...]] = {
    "compute": (0.3, 0.45, 0.6, 0.75),
    "half_tokens": (0.0, 128.0, 512.0),
    "memory": (0.5, 0.65, 0.8, 0.9),
    "link_latency_s": (0.0, 1e-5, 2e-5, 3e-5, 4e-5, 5e-5, 6e-5, 8e-5, 1e-4),
    "step_s": (0.001, 0.002, 0.003, 0.005, 0.008),
    "seq_s": (0.0, 5e-6, 2e-5),
}


class Unreplayable(ValueError):
    """A measurement the simulator cannot replay, and why."""


@dataclass(frozen=True)
class Case:
    """One published measurement, ready to replay."""

    source: Source
    measurement: Measurement
    model: ModelSpec
    hw: Hardware
    traffic: Traffic
    config: SimConfig

    @property
    def name(self) -> str:
        return f"{self.source.name}/{self.measurement.id}"

    @property
    def limits(self) -> dict[str, str]:
        """Each batch limit replayed and how it is known: "128 (stated)", "2048 (engine
        default)", or "256 (assumed)" where the source and its engine's cited defaults are
        silent (``ASSUMED_LIMITS``)."""
        out = {}
        for limit in LIMITS:
            basis = self.source.setup.limit_basis(limit)
            value = getattr(self.config.scheduler, limit)
            out[limit] = f"{value} ({'assumed' if basis == 'unknown' else basis})"
        return out


def _model(setup_model: str, params_b: float) -> ModelSpec:
    """The known architecture a source's model names (Llama 2 and 3.x, 7-8B and 70B)."""
    name = setup_model.lower()
    size = re.search(r"(\d+)\s*b\b", name.replace("-", " "))
    billions = int(size.group(1)) if size else round(params_b)
    if "llama" in name and billions in (8, 70) and re.search(r"llama[ -]?v?3", name):
        return model_spec(f"llama-3.1-{billions}b")
    if "llama" in name and billions in (7, 13, 70) and re.search(r"llama[ -]?v?2", name):
        return model_spec(f"llama-2-{billions}b")
    raise Unreplayable(f"model {setup_model!r}: not a Llama 2 or 3 7B/8B/13B/70B architecture")


def _hardware(gpu: str) -> Hardware:
    for key in ("H200", "H100", "A100", "L4"):
        if key.lower() in gpu.lower():
            hw = hardware(key)
            if key == "A100" and "40" in gpu:
                return replace(hw, name="A100-40GB", memory=40e9)
            return hw
    raise Unreplayable(f"GPU {gpu!r}: not one of H200, H100, A100, L4")


def case(source: Source, m: Measurement, max_requests: int = MAX_REQUESTS) -> Case:
    """``m`` as the simulator replays it; ``Unreplayable`` says why not."""
    setup, w = source.setup, m.workload
    model, hw = _model(setup.model, setup.params_b), _hardware(setup.gpu)
    if w.input_len is None or w.output_len is None:
        raise Unreplayable(f"dataset {w.dataset!r} without stated lengths")
    if setup.gpu_count % setup.tp:
        raise Unreplayable(f"{setup.gpu_count} GPUs are not whole replicas of tp {setup.tp}")
    closed = None if w.offline or w.request_rate is not None else w.concurrency
    rate = float(w.request_rate) if w.request_rate is not None else OFFLINE_RATE
    # unstated: a closed loop's ten rounds, or one batch of the concurrency all at once
    unstated = 10 * closed if closed else (w.concurrency if w.offline else None)
    count = min(w.num_prompts or unstated or max_requests, max_requests)
    lengths = LengthSpec(w.input_len, w.input_len), LengthSpec(w.output_len, w.output_len)
    traffic = Traffic(rate, count, *lengths, concurrency=closed)
    weights = replace(model, bytes_per_param=PRECISION_BYTES[setup.precision])
    free = hw.memory * setup.tp * 0.9 - weights.params * weights.bytes_per_param
    if free <= 0:
        raise Unreplayable(f"{model.name} does not fit on {setup.tp} x {hw.name}")
    config = SimConfig(
        replicas=setup.gpu_count // setup.tp,
        scheduler=SchedulerConfig(
            max_num_seqs=setup.max_num_seqs or ASSUMED_LIMITS["max_num_seqs"],
            max_num_batched_tokens=setup.max_num_batched_tokens
            or ASSUMED_LIMITS["max_num_batched_tokens"],
        ),
        num_blocks=min(400_000, int(free // (16 * model.kv_bytes_per_token))),
        mode="fleet",
        network_rtt_s=0.0,
        gateway_auth_s=0.0,
        gateway_ratelimit_s=0.0,
        gateway_safety_s=0.0,
        route_s=0.0,
    )
    return Case(source, m, model, hw, traffic, config)


def cases(
    sources: Sequence[Source], max_requests: int = MAX_REQUESTS
) -> tuple[list[Case], list[tuple[str, str]]]:
    """Every replayable measurement, and (name, reason) for the others."""
    found, skipped = [], []
    for source in sources:
        for m in source.measurements:
            try:
                found.append(case(source, m, max_requests))
            except Unreplayable as exc:
                skipped.append((f"{source.name}/{m.id}", str(exc)))
    return found, skipped


def predict(c: Case, eff: Efficiency) -> dict[str, float]:
    """The simulator's value of each figure ``c``'s source published."""
    cost = GpuStep(c.model, c.hw, c.source.setup.tp, c.source.setup.precision, eff)
    report = Simulator(c.config, cost).run(c.traffic).report
    out = {}
    for figure in c.measurement.figures:
        key, scale = REPORT_KEYS[figure]
        out[figure] = float(report[key]) * scale
    return out


def errors(c: Case, eff: Efficiency) -> dict[str, float]:
    """Each figure's relative error: |predicted - published| / published."""
    got = predict(c, eff)
    return {f: abs(got[f] - v) / v for f, v in c.measurement.figures.items()}


Mapper = Callable[[Callable[[Case], float], Sequence[Case]], Iterable[float]]


def case_error(c: Case, eff: Efficiency) -> float:
    """The mean relative error of ``c``'s figures."""
    return statistics.fmean(errors(c, eff).values())


def mean_error(found: Sequence[Case], eff: Efficiency, mapper: Mapper = map) -> float:
    """The mean relative error over every figure of ``found`` (each case's figures
    weighted as one measurement); ``mapper`` runs the replays (a process pool's ``map``)."""
    per_case = list(mapper(partial(case_error, eff=eff), found))
    return statistics.fmean(per_case) if per_case else math.inf


def fit(
    found: Sequence[Case],
    start: Efficiency | None = None,
    grid: dict[str, tuple[float, ...]] | None = None,
    sweeps: int = 4,
    progress: Callable[[Efficiency, float], None] = lambda eff, err: None,
    mapper: Mapper = map,
) -> tuple[Efficiency, float]:
    """The grid point with the least mean error, by coordinate search from ``start``:
    each term in turn takes the grid value that lowers the error most, ``sweeps`` times
    over (deterministic: the same cases give the same terms)."""
    grid = GRID if grid is None else grid
    best = start or Efficiency()
    best_error = mean_error(found, best, mapper)
    seen: dict[tuple[Any, ...], float] = {}
    for _ in range(sweeps):
        moved = False
        for term, values in grid.items():
            for value in values:
                trial = replace(best, **{term: value})
                key = tuple(vars(trial).values())
                if key not in seen:
                    seen[key] = mean_error(found, trial, mapper)
                if seen[key] < best_error - 1e-12:
                    best, best_error, moved = trial, seen[key], True
                    progress(best, best_error)
        if not moved:
            break
    return best, best_error
