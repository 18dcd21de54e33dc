"""The calibrated step-cost model: a step's time fitted to this machine's engine.

One coefficient per cost a step pays, fitted to the steps the engine logged
(`sendpath profile`). The runner computes every row of a step (a decode, a prompt
chunk's token) in the same matmuls and one paged attention call a layer, so:

    step = c_step + c_prompt * prompt_tokens + c_context * context_tokens
           + c_kv * kv_tokens + c_decode * decodes

``step``: once a step (weights streamed, every layer's kernels dispatched); ``prompt``:
the matmuls' work per prompt token; ``context``: the positions each token attends to,
summed (the attention kernel's work); ``kv``: the KV each sequence reads (a decode reads
its whole context for one token, where a chunk reads each key once for many);
``decode``: a decode's row, in a decode-only step or beside a prompt chunk.

Fitted by non-negative least squares (``scipy.optimize.nnls``: a negative cost would make
some shapes free) on relative error, so a 10 ms decode counts as much as a 2 s prefill,
each point weighted by the steps it stands for. Richer forms were tried on the profile
and the replayed runs in ``benchmarks/results/`` (a per-chunk cost, a riding decode
priced apart from a decode-only one, a per-batch-size curve): each fit the steps within
a point of this one's mean error and moved the fidelity results by a ratio or two of 36.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from sendpath.engine.steps import StepShape
from sendpath.sim.config import SimConfig

__all__ = [
    "TERMS",
    "Calibrated",
    "CostModelFileError",
    "FitError",
    "PointKind",
    "ProfilePoint",
    "points",
    "step_kind",
    "step_times",
]

TERMS = ("step", "prompt", "context", "kv", "decode")
FORMAT = "sendpath-profile"
VERSION = 8  # the only one read: earlier files had other forms
NEWER = ("draft_tokens",)  # step-shape fields a version-8 file may lack (0 there)


def _features(shape: StepShape) -> tuple[float, ...]:
    """The step's amount of each term (``TERMS``), in order."""
    decodes = shape.num_seqs - shape.prefills
    rows = shape.prompt_tokens + shape.draft_tokens  # a draft's row costs a prompt token's
    return (1.0, rows, shape.context_tokens, shape.kv_tokens, decodes)


class PointKind(StrEnum):
    PREFILL = "prefill"  # prompt chunks only
    DECODE = "decode"  # one-token steps only
    MIXED = "mixed"  # decodes + prefill chunks


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
    ) -> None:
        for term in TERMS:
            value = coefficients.get(term)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {term!r} must be a number >= 0, got {value!r}")
        self.coefficients = {term: float(coefficients[term]) for term in TERMS}
        self._c = [self.coefficients[t] for t in TERMS]
        self.points = list(points)
        self.meta = dict(meta or {})

    @classmethod
    def fit(cls, points: Sequence[ProfilePoint], meta: dict[str, Any] | None = None) -> Calibrated:
        if len(points) < len(TERMS):
            raise ValueError(f"fitting {len(TERMS)} terms needs as many points, got {len(points)}")
        if any(p.seconds <= 0 for p in points):
            raise ValueError("every measured step time must be > 0")
        weight = np.sqrt([[max(1, p.steps)] for p in points])
        features = np.array([_features(p.shape) for p in points])
        rows = features / np.array([[p.seconds] for p in points]) * weight
        scale = np.abs(rows).max(axis=0)
        scale[scale == 0] = 1.0  # a term no point exercises stays 0
        x = nnls(rows / scale, weight[:, 0])[0] / scale
        return cls(dict(zip(TERMS, map(float, x), strict=True)), points, meta)

    def step_seconds(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self._c, _features(shape), strict=True))

    def error(self, kind: PointKind | None = None) -> FitError | None:
        """Relative error on the points (of ``kind``); None without any."""
        errors = [
            abs(self.step_seconds(p.shape) - p.seconds) / p.seconds
            for p in self.points
            if kind in (None, p.kind)
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
        fit = self.error()
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
            "fit": asdict(fit) if fit else None,
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
                    StepShape(**{k: int(p.get(k, 0) if k in NEWER else p[k]) for k in shape}),
                    float(p["measured_s"]),
                    int(p["steps"]),
                )
                for p in data["points"]
            ]
            if not isinstance(data["meta"], dict):
                raise TypeError("meta is not an object")
            return cls(data["coefficients_s"], points, data["meta"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CostModelFileError(path, f"malformed ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------ from a step log to points


def step_kind(shape: StepShape) -> PointKind:
    """Decode (one-token steps only, or decodes with drafts), prefill (prompt chunks
    only) or mixed."""
    if shape.prefills == 0 and shape.num_tokens == shape.num_seqs + shape.draft_tokens:
        return PointKind.DECODE
    if shape.num_seqs == 1 or shape.num_seqs == shape.prefills:  # 1: logs before prefills
        return PointKind.PREFILL
    return PointKind.MIXED


def step_times(steps: list[dict[str, Any]]) -> list[tuple[StepShape, float]]:
    """Each logged step's shape and time (``GET /v1/steps``' records): its period when
    the next step followed at once."""
    out = []
    for step, nxt in zip(steps, [*steps[1:], None], strict=True):
        seconds = step["seconds"]
        if step["busy_after"] and nxt is not None and nxt["seq"] == step["seq"] + 1:
            seconds = max(seconds, nxt["start"] - step["start"])
        known = {f.name: int(step.get(f.name, 0)) for f in fields(StepShape)}  # old logs: 0
        out.append((StepShape(**known), seconds))
    return out


def points(label: str, timed: list[tuple[StepShape, float]]) -> list[ProfilePoint]:
    """One point per kind and size: the median step (by time) of each group."""
    groups: dict[tuple[PointKind, int, int], list[tuple[StepShape, float]]] = defaultdict(list)
    for shape, seconds in timed:
        groups[(step_kind(shape), shape.num_seqs, shape.num_tokens)].append((shape, seconds))
    found = []
    for (kind, seqs, tokens), items in sorted(groups.items()):
        shape, seconds = sorted(items, key=lambda item: item[1])[len(items) // 2]
        name = f"{label}: {kind.value} {tokens} tok / {seqs} seq ({len(items)} steps)"
        found.append(ProfilePoint(kind, name, shape, seconds, len(items)))
    return found
