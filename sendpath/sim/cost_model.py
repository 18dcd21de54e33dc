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

``Calibrated``: a linear model fitted to step times measured on the real engine
(`sendpath profile`), one coefficient per cost a step pays:

    step = c_step + c_token * tokens + c_seq * seqs + c_context * context + c_kv * kv

- ``c_step``: paid once a step whatever its size: the weights are streamed from memory
  once, and every layer's kernels are dispatched from Python once.
- ``c_token``: the matmuls' work per computed token (about ``2 x params`` FLOPs).
- ``c_seq``: per scheduled sequence: the scheduler's and the runner's Python, the block
  table, the logits over the vocabulary and the sampling of its next token.
- ``c_context``: attention FLOPs, ``sum over tokens of the positions each attends to``
  (quadratic in a prefill chunk, linear in a decode's context).
- ``c_kv``: bytes of KV each sequence reads (and the runner gathers) once a step: a
  decode's whole context.
Coefficients are fitted by non-negative least squares on relative error (each row
divided by its measured time), so a 40 ms decode counts as much as a 2 s prefill and no
term can go negative (a negative cost would make some shapes free). Measured on 2 CPU
cores (SmolLM2-135M, float32): within 8% on held-out mixed steps; what a line cannot
follow is the BLAS's small matrices: decodes of 2-4 sequences run up to a third slower
than the fit, a lone decode about a fifth faster.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sendpath.engine.scheduler import SchedulerOutput
from sendpath.sim.hardware import Hardware, ModelSpec
from sendpath.sim.nnls import nnls

__all__ = [
    "COMPUTE_EFF",
    "MEMORY_EFF",
    "TERMS",
    "Calibrated",
    "CostModel",
    "CostModelFileError",
    "PointKind",
    "ProfilePoint",
    "Roofline",
    "StepShape",
]

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


TERMS = ("step", "token", "seq", "context", "kv")
FORMAT = "sendpath-profile"
VERSION = 1


def _features(shape: StepShape) -> list[float]:
    """The step's amount of each of ``TERMS``, in order."""
    return [1.0, shape.num_tokens, shape.num_seqs, shape.context_tokens, shape.kv_tokens]


class PointKind(StrEnum):
    PREFILL = "prefill"  # one request's chunk
    DECODE = "decode"  # a batch of one-token steps
    MIXED = "mixed"  # decodes + one prefill chunk: held out, checks the fit, never fits it


@dataclass(frozen=True)
class ProfilePoint:
    """One grid point: a step's shape and the median wall time of such steps."""

    kind: PointKind
    label: str
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class FitError:
    """Relative errors ``|fitted - measured| / measured`` over a set of points."""

    max: float
    mean: float
    count: int


class CostModelFileError(ValueError):
    """A cost-model file that is missing or not a `sendpath profile` result."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(
            f"cost model {str(path)!r}: {problem}; run `sendpath profile --out {path}` to "
            "measure this machine and write one"
        )


class Calibrated:
    """A step time fitted to this machine's engine; see the module docstring for the terms.

    ``points`` are the measurements it came from (kept to report the fit's error), ``meta``
    what was measured: model, dtype, device, torch, CPU count, date, engine settings.
    """

    def __init__(
        self,
        coefficients: dict[str, float],
        points: Sequence[ProfilePoint] = (),
        meta: dict[str, Any] | None = None,
    ) -> None:
        for term in TERMS:
            value = coefficients.get(term)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {term!r} must be a number >= 0, got {value!r}")
        self.coefficients = {term: float(coefficients[term]) for term in TERMS}
        self.points = list(points)
        self.meta = dict(meta or {})

    @classmethod
    def fit(cls, points: Sequence[ProfilePoint], meta: dict[str, Any] | None = None) -> Calibrated:
        """Fit on every point but the held-out (mixed) ones; keep them all."""
        used = [p for p in points if p.kind is not PointKind.MIXED]
        if len(used) < len(TERMS):
            raise ValueError(f"fitting {len(TERMS)} terms needs as many points, got {len(used)}")
        if any(p.seconds <= 0 for p in used):
            raise ValueError("every measured step time must be > 0")
        rows = np.array([_features(p.shape) for p in used]) / np.array(
            [[p.seconds] for p in used]
        )  # relative error: row i divided by measured time i, target 1
        scale = np.abs(rows).max(axis=0)
        scale[scale == 0] = 1.0  # a term no point exercises stays 0
        x = nnls(rows / scale, np.ones(len(used))) / scale
        return cls(dict(zip(TERMS, (float(v) for v in x), strict=True)), points, meta)

    def step_seconds(self, shape: StepShape) -> float:
        c = self.coefficients
        return sum(c[t] * f for t, f in zip(TERMS, _features(shape), strict=True))

    def error(self, held_out: bool = False) -> FitError | None:
        """Relative error on the fit points, or on the held-out ones; None without any."""
        errors = [
            abs(self.step_seconds(p.shape) - p.seconds) / p.seconds
            for p in self.points
            if (p.kind is PointKind.MIXED) == held_out
        ]
        if not errors:
            return None
        return FitError(max(errors), sum(errors) / len(errors), len(errors))

    @property
    def model_name(self) -> str:
        return str(self.meta.get("model", "unknown model"))

    @property
    def device(self) -> str:
        return str(self.meta.get("device", "unknown device"))

    @property
    def engine(self) -> dict[str, int]:
        """The profiled engine's integer settings (KV blocks, block size, batch limits)."""
        found = self.meta.get("engine")
        if not isinstance(found, dict):
            return {}
        return {k: v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}

    def to_json(self) -> dict[str, Any]:
        fit, held = self.error(), self.error(held_out=True)
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "coefficients_s": self.coefficients,
            "fit": {
                "terms": "step + token*num_tokens + seq*num_seqs + context*context_tokens "
                "+ kv*kv_tokens (seconds)",
                "fit_points": asdict(fit) if fit else None,
                "held_out": asdict(held) if held else None,
            },
            "points": [
                {
                    "kind": p.kind.value,
                    "label": p.label,
                    **asdict(p.shape),
                    "measured_s": p.seconds,
                    "fitted_s": self.step_seconds(p.shape),
                }
                for p in self.points
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibrated:
        """Read a `sendpath profile` file; ``CostModelFileError`` (a ValueError) if bad."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CostModelFileError(path, "no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CostModelFileError(path, f"cannot read it ({exc})") from None
        except json.JSONDecodeError as exc:
            raise CostModelFileError(path, f"not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelFileError(path, f'not a {FORMAT} file (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise CostModelFileError(path, f"version {data.get('version')!r}, expected {VERSION}")
        try:
            points = [
                ProfilePoint(
                    PointKind(p["kind"]),
                    str(p["label"]),
                    StepShape(**{f.name: int(p[f.name]) for f in fields(StepShape)}),
                    float(p["measured_s"]),
                )
                for p in data.get("points", [])
            ]
            meta = data.get("meta", {})
            if not isinstance(meta, dict):
                raise TypeError("meta is not an object")
            return cls(data["coefficients_s"], points, meta)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CostModelFileError(path, f"malformed ({type(exc).__name__}: {exc})") from None
