"""The calibrated step-cost model: a step's time fitted to this machine's engine.

A linear model fitted to step times measured on the real engine (`sendpath profile`),
one coefficient per cost a step pays. The form since file version 3
(``split``) tells the prompt's tokens from the decodes', because the runner runs them
differently:

    step = c_step + c_prompt * prompt_tokens + c_prefill * prefill_chunks
           + c_resume * resumed_chunks + c_context * context + c_kv * kv_gathered
           + (c_prefilling + c_ride * decodes   if the step has a prefill chunk
              + c_riding                      and any decode beside it
              else seqs(decodes))

- ``c_step``: paid once a step whatever its size: the weights are streamed from memory
  once, and every layer's kernels are dispatched from Python once.
- ``c_prompt``: the matmuls' work per prompt token (about ``2 x params`` FLOPs), in big
  batched GEMMs; ``c_prefill``: per prefill chunk (its own attention call, its mask and
  context gather, and for a first chunk the request's admission); ``c_prefilling``: once
  a step that runs any prefill chunk (the runner's prompt path: packing the chunks,
  their masks and positions, their logits rows; since file version 4); ``c_resume``: per chunk
  that does not start at position 0 (a long prompt's later chunk, or the rest of a prompt
  after a prefix-cache hit, as every chat request's system prompt is): the runner
  attends it through an explicit mask, where a chunk from 0 takes the fused causal
  kernel (15-21 ms more in this CPU's fits).
- ``seqs``: a decode-only step's sequences: the scheduler's and the runner's Python, the
  block table, the logits over the vocabulary and the sampling of each next token, and
  their rows of the matmuls. A line through a fitted value at each measured batch size
  (1, 2, 4, ...; ``seqs@k``, 0 at one sequence), carried on past the last with its last
  slope.
- ``c_ride``: a decode in a step that also runs a prefill chunk: its rows ride in the
  chunk's GEMMs, so it costs far less than in a decode-only step (0.1-4 ms in this CPU's
  fits, against 3-25 ms a sequence in a decode-only step).
- ``c_riding``: once a step that runs decodes beside prompt chunks (since file version
  5): the decodes' own attention call in every layer, which a prompt-only step skips and
  a decode-only step pays in ``c_step`` (7.5-33 ms in this CPU's served fits).
- ``c_context``: attention FLOPs, ``sum over tokens of the positions each attends to``
  (quadratic in a prefill chunk, linear in a decode's context).
- ``c_kv``: KV the runner gathers for attention once a step: each chunk's context, and
  the decodes as one batch padded to the longest (``CpuStepShape.kv_gathered``).
Files of versions 1 and 2 (written before steps told prompt from decode tokens) keep
their form: ``c_token * num_tokens + c_kv * kv_tokens + seqs(num_seqs)`` (version 1 a
straight ``c_seq * num_seqs``) and still load.

Coefficients are fitted by non-negative least squares on relative error (each row divided
by its measured time), so a 40 ms decode counts as much as a 2 s prefill and no term can
go negative (a negative cost would make some shapes free); each point is weighted by the
steps it stands for. Why each piece (benchmarks/README.md, sim_fidelity, has the runs):
the split, because one per-token cost priced 512-token chunks 7-10% high and long-prompt
runs came out 10-34% slow; ``c_prefilling``, because without it 9 chunks in a step were
priced as 9 steps' worth and ``c_ride`` fitted to 0 (chat mixed steps 11-14% low);
``c_riding``, because without it a short prompt's step beside a few decodes (a chat
server's usual step) was priced 15% low in the profile and 1-5% low in served runs; bends,
because on 2 CPU cores 4 decodes cost nearly what 8 do (one slope was 30% off there).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from sendpath.runner.cpu_step import CpuStepShape
from sendpath.sim.nnls import nnls

__all__ = ["TERMS", "Calibrated", "CostModelFileError", "CpuStepShape", "FitError", "PointKind",
           "ProfilePoint"]  # fmt: skip

TERMS = ("step", "token", "seq", "context", "kv")  # the linear form
SPLIT_TERMS = ("step", "prompt", "prefill", "prefilling", "resume", "context", "kv",
               "ride", "riding")  # + the decodes' terms  # fmt: skip
FORMAT = "sendpath-profile"
VERSION = 5  # 2: a piecewise-linear per-sequence cost (``seq_knots``); 3: ``split``
ADDED = {"prefilling": 4, "riding": 5}  # split terms since version N (0 in older files)


def seq_knots_for(batch_sizes: set[int]) -> tuple[int, ...]:
    """Where the per-sequence cost may bend: 1 and the powers of two among the measured
    batch sizes (each knot's value needs a point there)."""
    knots = [1] + [k for k in sorted(batch_sizes) if k > 1 and k & (k - 1) == 0]
    return tuple(knots) if len(knots) > 1 else ()


def _terms(knots: tuple[int, ...], split: bool = False) -> tuple[str, ...]:
    seqs = tuple(f"seqs@{k}" for k in knots[1:])
    if split:
        return (*SPLIT_TERMS, *(seqs or ("seq",)))
    if not knots:
        return TERMS
    return ("step", "token", "context", "kv", *seqs)


def _bends(s: int, knots: tuple[int, ...]) -> list[float]:
    """Weights of the per-sequence values at ``knots[1:]`` for ``s`` sequences: a line
    through them (0 at one sequence), carried on past the last knot with its last slope."""
    weights = [0.0] * (len(knots) - 1)
    i = max(
        1, min(len(knots) - 1, next((j for j, k in enumerate(knots) if k >= s), len(knots) - 1))
    )
    lo, hi = knots[i - 1], knots[i]
    w = (s - lo) / (hi - lo)  # > 1 past the last knot: extrapolation
    weights[i - 1] += w
    if i >= 2:
        weights[i - 2] += 1 - w
    return weights


def _features(shape: CpuStepShape, knots: tuple[int, ...] = (), split: bool = False) -> list[float]:
    """The step's amount of each of ``_terms(knots, split)``, in order."""
    if split:
        decodes = shape.num_seqs - shape.prefills
        ride = float(decodes) if shape.prefills else 0.0
        riding = 1.0 if ride else 0.0
        alone = 0 if shape.prefills else decodes  # a decode-only step's sequences
        if not knots:
            seqs = [float(alone)]
        else:
            seqs = _bends(alone, knots) if alone else [0.0] * (len(knots) - 1)
        return [1.0, float(shape.prompt_tokens), float(shape.prefills),
                1.0 if shape.prefills else 0.0, float(shape.resumed),
                float(shape.context_tokens), float(shape.kv_gathered), ride, riding,
                *seqs]  # fmt: skip
    base = [1.0, float(shape.num_tokens), float(shape.context_tokens), float(shape.kv_tokens)]
    if not knots:
        return [base[0], base[1], float(shape.num_seqs), base[2], base[3]]
    return base + _bends(shape.num_seqs, knots)


def _held_out(points: Sequence[ProfilePoint], split: bool) -> list[bool]:
    """Which points check the fit instead of making it: the mixed steps (prefill chunks
    with decodes riding along); in the ``split`` form, which prices the riders, every
    second one (the others fit that price)."""
    mixed = itertools.count()
    return [p.kind is PointKind.MIXED and (not split or next(mixed) % 2 == 1) for p in points]


def _unfitted(used: Sequence[ProfilePoint]) -> set[str]:
    """Split terms these points cannot tell from others (left at 0): ``prefilling``
    unless some step runs several chunks (else it is ``prefill``'s column); ``riding``
    unless prompt steps come with no decodes and with two numbers of them (else it is
    ``prefilling``'s column, or ``ride``'s)."""
    beside = {p.shape.num_seqs - p.shape.prefills for p in used if p.shape.prefills}
    prefilling = {"prefilling"} if all(p.shape.prefills < 2 for p in used) else set()
    return prefilling | ({"riding"} if 0 not in beside or len(beside) < 3 else set())


def _logged_split(points: Sequence[ProfilePoint]) -> bool:
    """Whether the points carry the prompt/decode split (steps logged before it did not)."""
    return bool(points) and all(p.shape.kv_gathered > 0 or p.shape.kv_tokens == 0 for p in points)


class PointKind(StrEnum):
    PREFILL = "prefill"  # prompt chunks only
    DECODE = "decode"  # a batch of one-token steps
    MIXED = "mixed"  # decodes + prefill chunks: held out (every second one in ``split``)


@dataclass(frozen=True)
class ProfilePoint:
    """One grid point: a step's shape and the median wall time of such steps; ``steps``:
    how many steps it stands for (the fit counts every step the engine ran once)."""

    kind: PointKind
    label: str
    shape: CpuStepShape
    seconds: float
    steps: int = 1


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
        seq_knots: Sequence[int] = (),
        split: bool = False,
    ) -> None:
        knots = tuple(int(k) for k in seq_knots)
        if knots and (knots[0] != 1 or any(b <= a for a, b in itertools.pairwise(knots))):
            raise ValueError(f"seq_knots must rise from 1, got {list(knots)}")
        self.seq_knots, self.split = knots, split
        self.terms = _terms(knots, split)
        if split:  # a term added since the file was fitted: not paid
            coefficients = {**{t: 0.0 for t in ADDED}, **coefficients}
        for term in self.terms:
            value = coefficients.get(term)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {term!r} must be a number >= 0, got {value!r}")
        self.coefficients = {term: float(coefficients[term]) for term in self.terms}
        self._c = [self.coefficients[t] for t in self.terms]
        self.points = list(points)
        self.held_out = _held_out(self.points, split)
        self.meta = dict(meta or {})

    @classmethod
    def fit(
        cls,
        points: Sequence[ProfilePoint],
        meta: dict[str, Any] | None = None,
        piecewise: bool = True,
    ) -> Calibrated:
        """Fit on every point but the held-out ones; keep them all. ``piecewise``: the
        per-sequence cost bends at the measured batch sizes 1, 2, 4, ... (given twice as
        many points as terms; else it is a line). Points that tell prompt from decode
        tokens (logged since they were kept) are fitted in the ``split`` form."""
        split = _logged_split(points)
        held = _held_out(points, split)
        used = [p for p, out in zip(points, held, strict=True) if not out]
        alone = {p.shape.num_seqs for p in used if not (split and p.shape.prefills)}
        knots = seq_knots_for(alone) if piecewise else ()
        off = _unfitted(used) if split else set()
        if len(used) < 2 * (len(_terms(knots, split)) - len(off)):
            knots = ()  # too few points to bend: a line
        terms = _terms(knots, split)
        fitted = [t not in off for t in terms]
        if len(used) < sum(fitted):
            raise ValueError(f"fitting {sum(fitted)} terms needs as many points, got {len(used)}")
        if any(p.seconds <= 0 for p in used):
            raise ValueError("every measured step time must be > 0")
        # relative error (row i divided by measured time i, target 1), each point
        # weighted by the steps it stands for: least squares over the steps themselves
        weight = np.sqrt([[max(1, p.steps)] for p in used])
        rows = (
            np.array([_features(p.shape, knots, split) for p in used])[:, fitted]
            / np.array([[p.seconds] for p in used])
            * weight
        )
        scale = np.abs(rows).max(axis=0)
        scale[scale == 0] = 1.0  # a term no point exercises stays 0
        x = iter(nnls(rows / scale, weight[:, 0]) / scale)
        coefficients = {
            t: float(next(x)) if on else 0.0 for t, on in zip(terms, fitted, strict=True)
        }
        return cls(coefficients, points, meta, knots, split)

    def step_seconds(self, shape: CpuStepShape) -> float:
        features = _features(shape, self.seq_knots, self.split)
        return sum(c * f for c, f in zip(self._c, features, strict=True))

    @property
    def unfitted(self) -> set[str]:
        """Split terms the fitted points could not tell apart from others (left at 0)."""
        if not self.split:
            return set()
        return _unfitted([p for p, out in zip(self.points, self.held_out, strict=True) if not out])

    def error(self, held_out: bool = False) -> FitError | None:
        """Relative error on the fit points, or on the held-out ones; None without any."""
        errors = [
            abs(self.step_seconds(p.shape) - p.seconds) / p.seconds
            for p, out in zip(self.points, self.held_out, strict=True)
            if out == held_out
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

    def outside_steps(self) -> dict[str, Any]:
        """``SimConfig`` fields a served profile measured beyond the steps: a request's
        time outside them as the round trip, and the output filter's hold on first
        tokens. ``ValueError`` for a hold that is not a list of shares."""
        out: dict[str, Any] = {}
        overhead = self.meta.get("request_overhead_s")
        if isinstance(overhead, int | float) and overhead > 0:
            out["network_rtt_s"] = float(overhead)
        hold = self.meta.get("first_token_hold")
        if hold:
            if not isinstance(hold, list) or not all(isinstance(x, int | float) for x in hold):
                raise ValueError(f"first_token_hold must be a list of shares; got {hold!r}")
            out["first_token_hold"] = tuple(float(x) for x in hold)
        return out

    def to_json(self) -> dict[str, Any]:
        fit, held = self.error(), self.error(held_out=True)
        points = [{"kind": p.kind.value, "label": p.label, **asdict(p.shape),
                   "measured_s": p.seconds, "fitted_s": self.step_seconds(p.shape),
                   "steps": p.steps} for p in self.points]  # fmt: skip
        return {
            "format": FORMAT, "version": VERSION, "meta": self.meta,
            "coefficients_s": self.coefficients, "seq_knots": list(self.seq_knots),
            "split": self.split,
            "fit": {"terms": self.describe_terms(),
                    "fit_points": asdict(fit) if fit else None,
                    "held_out": asdict(held) if held else None},
            "points": points,
        }  # fmt: skip

    def describe_terms(self) -> str:
        """The fitted form in words (the file's ``fit.terms``)."""
        seqs = "seqs(S) through seqs@k at each knot k, 0 at S=1" if self.seq_knots else "seq*S"
        if self.split:
            return (
                "step + prompt*prompt_tokens + prefill*prefills + resume*resumed + "
                "context*context_tokens + kv*kv_gathered + (prefilling + ride*decodes + "
                f"riding if any with a prefill, else {seqs} over S decodes) (seconds)"
            )
        return (
            "step + token*num_tokens + context*context_tokens + kv*kv_tokens + "
            f"{seqs} over S=num_seqs (seconds)"
        )

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
        if data.get("version") not in range(1, VERSION + 1):
            raise CostModelFileError(
                path, f"version {data.get('version')!r}, expected 1 to {VERSION}"
            )
        try:
            points = [
                ProfilePoint(
                    PointKind(p["kind"]),
                    str(p["label"]),
                    CpuStepShape(
                        **{
                            f.name: int(p[f.name])
                            for f in fields(CpuStepShape)
                            if f.name in p or f.default is MISSING
                        }
                    ),
                    float(p["measured_s"]),
                    int(p.get("steps", 1)),
                )
                for p in data.get("points", [])
            ]
            meta = data.get("meta", {})
            if not isinstance(meta, dict):
                raise TypeError("meta is not an object")
            split = data.get("split", False)
            if not isinstance(split, bool):
                raise TypeError(f"split must be true or false, got {split!r}")
            coefficients = data["coefficients_s"]
            for term, since in ADDED.items():  # only files from before lack it
                if split and data["version"] >= since and term not in coefficients:
                    raise KeyError(term)
            return cls(coefficients, points, meta, data.get("seq_knots", []), split)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CostModelFileError(path, f"malformed ({type(exc).__name__}: {exc})") from None
