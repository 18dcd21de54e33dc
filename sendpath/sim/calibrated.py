"""The calibrated step-cost model: a step's time fitted to this machine's engine.

One coefficient per cost a step pays, fitted to the steps the engine logged
(`sendpath profile`). The runner computes every row of a step (a decode, a prompt
chunk's token) in the same matmuls and one paged attention call a layer, so:

    step = c_step + c_prompt * prompt_tokens + c_prefill * prefills
           + c_context * context_tokens + c_kv * kv_tokens
           + (c_ride * decodes   if the step has a prompt chunk   else seqs(decodes))

``step``: once a step (weights streamed, every layer's kernels dispatched); ``prompt``:
the matmuls' work per prompt token; ``prefill``: per chunk (its sequence's tables, its
sampled token); ``context``: the positions each token attends to, summed (the attention
kernel's work); ``kv``: the KV each sequence reads (a decode reads its whole context for
one token, where a chunk reads each key once for many); ``ride``: a decode beside a chunk,
its row one more in the chunk's matmuls; ``seqs``: a decode-only step's sequences, a line
through a value fitted at each measured power-of-two batch size (``seqs@k``, 0 at one),
its last slope carried on (few rows leave the matmuls waiting on the weights' bytes: on
2 CPU cores 4 decodes cost nearly what 8 do).

Fitted by non-negative least squares (``scipy.optimize.nnls``: a negative cost would make
some shapes free) on relative error, so a 40 ms decode counts as much as a 2 s prefill,
each point weighted by the steps it stands for; every second mixed step is held out.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from sendpath.engine.steps import StepShape
from sendpath.sim.config import SimConfig

__all__ = ["TERMS", "Calibrated", "CostModelFileError", "FitError", "PointKind", "ProfilePoint"]

TERMS = ("step", "prompt", "prefill", "context", "kv", "ride")  # then ``seqs@k`` per knot k > 1
FORMAT = "sendpath-profile"
VERSION = 7  # the only one read: earlier files had other forms


def _bends(s: int, knots: tuple[int, ...]) -> list[float]:
    """Weights of the values at ``knots[1:]`` for ``s`` sequences (0 at one sequence)."""
    weights = [0.0] * (len(knots) - 1)
    if s <= 1 or not weights:
        return weights
    i = next((j for j, k in enumerate(knots) if k >= s), len(knots) - 1)
    lo, hi = knots[i - 1], knots[i]
    w = (s - lo) / (hi - lo)  # > 1 past the last knot: extrapolation
    weights[i - 1] += w
    if i >= 2:
        weights[i - 2] += 1 - w
    return weights


def _features(shape: StepShape, knots: tuple[int, ...]) -> list[float]:
    """The step's amount of each term (``TERMS``, then the knots'), in order."""
    decodes = shape.num_seqs - shape.prefills
    return [
        1.0,
        float(shape.prompt_tokens),
        float(shape.prefills),
        float(shape.context_tokens),
        float(shape.kv_tokens),
        float(decodes) if shape.prefills else 0.0,
        *_bends(0 if shape.prefills else decodes, knots),
    ]


def _held_out(points: Sequence[ProfilePoint]) -> list[bool]:
    """Every second mixed step checks the fit (the others price the riding decodes)."""
    mixed = itertools.count()
    return [p.kind is PointKind.MIXED and next(mixed) % 2 == 1 for p in points]


class PointKind(StrEnum):
    PREFILL = "prefill"  # prompt chunks only
    DECODE = "decode"  # one-token steps only
    MIXED = "mixed"  # decodes + prefill chunks: every second one held out


@dataclass(frozen=True)
class ProfilePoint:
    """A step's shape and its (median) wall time; ``steps``: how many steps it stands for."""

    kind: PointKind
    label: str
    shape: StepShape
    seconds: float
    steps: int = 1


@dataclass(frozen=True)
class FitError:
    """Relative errors ``|fitted - measured| / measured`` over a set of points."""

    max: float
    mean: float
    count: int


class CostModelFileError(ValueError):
    """A cost-model file that is missing, old or not a `sendpath profile` result."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(
            f"cost model {str(path)!r}: {problem}; run `sendpath profile --out {path}` (on an "
            "idle machine) to measure this machine and write one"
        )


class Calibrated:
    """A step time fitted to this machine's engine (the terms: the module docstring).

    ``points``: the measurements it came from (kept to report the fit's error); ``meta``:
    what was measured (model, dtype, device, engine settings, date).
    """

    def __init__(
        self,
        coefficients: dict[str, float],
        points: Sequence[ProfilePoint] = (),
        meta: dict[str, Any] | None = None,
        seq_knots: Sequence[int] = (1,),
    ) -> None:
        knots = tuple(int(k) for k in seq_knots)
        if knots[:1] != (1,) or any(b <= a for a, b in itertools.pairwise(knots)):
            raise ValueError(f"seq_knots must rise from 1, got {list(knots)}")
        self.seq_knots = knots
        self.terms = (*TERMS, *(f"seqs@{k}" for k in knots[1:]))
        for term in self.terms:
            value = coefficients.get(term)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {term!r} must be a number >= 0, got {value!r}")
        self.coefficients = {term: float(coefficients[term]) for term in self.terms}
        self._c = [self.coefficients[t] for t in self.terms]
        self.points = list(points)
        self.held_out = _held_out(self.points)
        self.meta = dict(meta or {})

    @classmethod
    def fit(cls, points: Sequence[ProfilePoint], meta: dict[str, Any] | None = None) -> Calibrated:
        """Fit on every point but the held-out ones; keep them all."""
        used = [p for p, out in zip(points, _held_out(points), strict=True) if not out]
        # the per-sequence cost may bend at 1 and at each measured power-of-two batch size
        batches = sorted({p.shape.num_seqs for p in used if not p.shape.prefills})
        knots = (1, *(k for k in batches if k > 1 and k & (k - 1) == 0))
        terms = (*TERMS, *(f"seqs@{k}" for k in knots[1:]))
        if len(used) < len(terms):
            raise ValueError(f"fitting {len(terms)} terms needs as many points, got {len(used)}")
        if any(p.seconds <= 0 for p in used):
            raise ValueError("every measured step time must be > 0")
        weight = np.sqrt([[max(1, p.steps)] for p in used])
        features = np.array([_features(p.shape, knots) for p in used])
        rows = features / np.array([[p.seconds] for p in used]) * weight
        scale = np.abs(rows).max(axis=0)
        scale[scale == 0] = 1.0  # a term no point exercises stays 0
        x = nnls(rows / scale, weight[:, 0])[0] / scale
        return cls(dict(zip(terms, map(float, x), strict=True)), points, meta, knots)

    def step_seconds(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self._c, _features(shape, self.seq_knots), strict=True))

    def error(self, held_out: bool = False) -> FitError | None:
        """Relative error on the fit points, or on the held-out ones; None without any."""
        errors = [
            abs(self.step_seconds(p.shape) - p.seconds) / p.seconds
            for p, out in zip(self.points, self.held_out, strict=True)
            if out == held_out
        ]
        return FitError(max(errors), sum(errors) / len(errors), len(errors)) if errors else None

    @property
    def model_name(self) -> str:
        return str(self.meta.get("model", "unknown model"))

    @property
    def device(self) -> str:
        return str(self.meta.get("device", "unknown device"))

    def sim_config(self, c: SimConfig) -> SimConfig:
        """``c`` with the profiled engine's KV cache and batch limits and, from a served
        profile, what it measured beyond the steps: a request's time outside them as the
        round trip, and the output filter's hold on first tokens. ``ValueError`` for a
        hold that is not a list of shares."""
        found = self.meta.get("engine")
        settings = found.items() if isinstance(found, dict) else []
        engine = {k: v for k, v in settings if isinstance(v, int) and not isinstance(v, bool)}
        limits: dict[str, Any] = {
            k: engine[k] for k in ("max_num_seqs", "max_num_batched_tokens") if k in engine
        }
        out: dict[str, Any] = {k: engine[k] for k in ("num_blocks", "block_size") if k in engine}
        overhead = self.meta.get("request_overhead_s")
        if isinstance(overhead, int | float) and overhead > 0:
            out["network_rtt_s"] = float(overhead)
        hold = self.meta.get("first_token_hold")
        if hold:
            if not isinstance(hold, list) or not all(isinstance(x, int | float) for x in hold):
                raise ValueError(f"first_token_hold must be a list of shares; got {hold!r}")
            out["first_token_hold"] = tuple(float(x) for x in hold)
        return replace(c, scheduler=replace(c.scheduler, **limits), **out)

    def save(self, path: str | Path) -> None:
        fit, held = self.error(), self.error(held_out=True)
        points = [
            {
                "kind": p.kind.value,
                "label": p.label,
                **asdict(p.shape),
                "measured_s": p.seconds,
                "fitted_s": self.step_seconds(p.shape),
                "steps": p.steps,
            }
            for p in self.points
        ]
        data = {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "coefficients_s": self.coefficients,
            "seq_knots": list(self.seq_knots),
            "fit": {
                "fit_points": asdict(fit) if fit else None,
                "held_out": asdict(held) if held else None,
            },
            "points": points,
        }
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibrated:
        """Read a `sendpath profile` file; ``CostModelFileError`` (a ValueError) if bad."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CostModelFileError(path, "no such file") from None
        except (OSError, ValueError) as exc:  # unreadable, not UTF-8 or not JSON
            raise CostModelFileError(path, f"not JSON, or unreadable ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelFileError(path, f'not a {FORMAT} file (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise CostModelFileError(
                path, f"version {data.get('version')!r}, and this sendpath reads only {VERSION}"
            )
        try:
            shape = [f.name for f in fields(StepShape)]
            points = [
                ProfilePoint(
                    PointKind(p["kind"]),
                    str(p["label"]),
                    StepShape(**{k: int(p[k]) for k in shape}),
                    float(p["measured_s"]),
                    int(p["steps"]),
                )
                for p in data["points"]
            ]
            if not isinstance(data["meta"], dict):
                raise TypeError("meta is not an object")
            return cls(data["coefficients_s"], points, data["meta"], data["seq_knots"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CostModelFileError(path, f"malformed ({type(exc).__name__}: {exc})") from None
