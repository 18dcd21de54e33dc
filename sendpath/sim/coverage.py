"""What the fitted GPU step terms cover, and the refusal to price a run far outside it.

The terms in ``gpu_calibration.json`` rest on the published sources it names as fitted on
or held out (``fitted_on``, ``held_out``) whose measurements the simulator replays
(``gpu_fit.cases``: a source whose every figure is unreplayable, such as a ShareGPT run
without stated lengths, gave the fit and its error nothing, so it is not counted). Those
sources' setups (``gpu_sources/``, mapped to our GPUs and models as the replay maps them)
say what is covered, and a GPU run is outside it (``Coverage.outside``) when:

- its GPU is not one a source measured (a GPU no source ran has only its datasheet);
- its model has fewer than ``MODEL_BELOW`` x the smallest source model's parameters, or
  more than ``MODEL_ABOVE`` x the largest's (a step's cost scales with the shapes, but a
  tiny model's launch-bound steps or a giant's were never seen);
- its tensor parallelism is above the largest a source ran (more devices' all-reduces,
  or across nodes, were never measured);
- its weights' precision is one no source ran and the fit did not take as its own
  (``fit_precisions``: bf16 and fp16, the same bytes and peak to the step model);
- its traffic's longest request (the shared prefix, then every turn's question and answer,
  at their longest) holds more than ``CONTEXT_ABOVE`` x the tokens of the longest a source
  ran (attention's cost and the KV cache's room at such lengths were never measured).

Nothing is listed here by hand: every range comes from the files, so a new source widens
it. The held-out error shown is the one for the run's precision (fp8 has its own: it was
held out, never fitted). The cpu entry (a roofline) and a `sendpath profile` cost model
keep their own calibration and are not checked here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sendpath.sim.gpu_fit import cases
from sendpath.sim.gpu_model import Calibration, calibration
from sendpath.sim.gpu_sources import Source, load_sources
from sendpath.sim.hardware import HARDWARE, ModelSpec
from sendpath.sim.traffic import Traffic

__all__ = [
    "CONTEXT_ABOVE", "MODEL_ABOVE", "MODEL_BELOW", "Coverage", "OutsideCalibration", "coverage",
]  # fmt: skip

MODEL_BELOW = 0.5  # of the smallest calibrated model's parameters: less is refused
MODEL_ABOVE = 1.5  # of the largest's: more is refused
CONTEXT_ABOVE = 1.5  # of the longest calibrated request's tokens: more is refused
KIND_NAMES = {"throughput": "throughput", "tpot": "TPOT", "ttft": "TTFT", "e2e": "E2E"}
ALLOW_FLAG = "--allow-extrapolation"


@dataclass(frozen=True)
class Coverage:
    """The published setups the fitted GPU terms rest on, and their held-out errors."""

    published: int  # sources the calibration lists
    fitted_on: tuple[str, ...]  # source names
    held_out: tuple[str, ...]
    engines: tuple[str, ...]  # "TensorRT-LLM 0.5/0.6.1/0.13.0", ...
    gpus: tuple[str, ...]  # ``HARDWARE`` keys
    models: tuple[str, ...]  # ``ModelSpec`` names
    params: tuple[int, int]  # the smallest and the largest model's parameters
    tps: tuple[int, ...]
    context: int  # the longest request a replayed measurement ran, prompt and answer
    fitted_precisions: tuple[str, ...]
    precisions: tuple[str, ...]  # fitted or held out
    errors: dict[str, dict[str, Any]]  # precision -> kind of figure -> count, mean, max
    error_sources: dict[str, int]  # precision -> held-out sources its error was measured on

    @classmethod
    def of(cls, cal: Calibration, sources: Sequence[Source]) -> Coverage:
        """What ``cal`` rests on, read from the setups of ``sources`` it names."""
        fitted, held = set(cal.fitted_on), set(cal.held_out)
        found, _ = cases([s for s in sources if s.name in fitted | held])
        if not found:
            raise ValueError("the GPU calibration rests on no replayable published source")
        used = {c.source.name: c.source for c in found}  # each source once
        setups = [src.setup for src in used.values()]
        fit_precisions = cal.fit_precisions or tuple(
            sorted({src.setup.precision for name, src in used.items() if name in fitted})
        )
        precisions = tuple(sorted({s.precision for s in setups} | set(fit_precisions)))
        held_precisions = [src.setup.precision for name, src in used.items() if name in held]
        versions: dict[str, set[str]] = {}
        for src in used.values():
            engine = re.sub(r"\s*\(.*?\)", "", src.engine)  # "LMDeploy (TurboMind)"
            versions.setdefault(engine, set()).add(src.engine_version)
        params = [c.model.params for c in found]
        return cls(
            published=len(cal.sources),
            fitted_on=tuple(sorted(used.keys() & fitted)),
            held_out=tuple(sorted(used.keys() & held)),
            engines=tuple(
                f"{e} {'/'.join(sorted(versions[e], key=_version_key))}"
                for e in sorted(versions, key=str.lower)
            ),
            gpus=tuple(sorted({_hardware_key(c.hw.name) for c in found})),
            models=tuple(sorted({c.model.name for c in found})),
            params=(min(params), max(params)),
            tps=tuple(sorted({s.tp for s in setups})),
            context=max(c.traffic.longest_request for c in found),
            fitted_precisions=fit_precisions,
            precisions=precisions,
            errors={p: cal.error_for(p) for p in precisions},
            # split as the calibration splits its held-out error: fp8's, or the others'
            error_sources={
                p: sum((h == "fp8") == (p == "fp8") for h in held_precisions) for p in precisions
            },
        )

    @property
    def priced_params(self) -> tuple[float, float]:
        """The parameter counts a run may have without extrapolating."""
        return self.params[0] * MODEL_BELOW, self.params[1] * MODEL_ABOVE

    @property
    def priced_context(self) -> int:
        """The most tokens a run's longest request may hold without extrapolating."""
        return int(self.context * CONTEXT_ABOVE)

    def outside(
        self,
        hw_key: str,
        model: ModelSpec,
        tp: int,
        precision: str,
        traffic: Traffic | None = None,
    ) -> list[str]:
        """What of a run lies far outside the calibration, one phrase each (empty: inside)."""
        found = []
        if hw_key not in self.gpus:
            found.append(
                f"GPU {hw_key} was measured by no source (calibrated: {', '.join(self.gpus)})"
            )
        low, high = self.priced_params
        if not low <= model.params <= high:
            found.append(
                f"model {model.name} has {_billions(model.params)} parameters, outside "
                f"{_billions(low)}-{_billions(high)} ({MODEL_BELOW:g}x the smallest to "
                f"{MODEL_ABOVE:g}x the largest calibrated model: {_billions(self.params[0])}-"
                f"{_billions(self.params[1])})"
            )
        if tp > max(self.tps):
            found.append(
                f"tensor parallelism {tp} is above the largest calibrated, {max(self.tps)} "
                f"(calibrated: tp {', '.join(map(str, self.tps))})"
            )
        if precision not in self.precisions:
            found.append(
                f"precision {precision} was run by no source "
                f"(calibrated: {', '.join(self.precisions)})"
            )
        if traffic is not None and traffic.longest_request > self.priced_context:
            found.append(
                f"its longest request holds {traffic.longest_request:,} tokens (shared prefix, "
                f"then every turn's question and answer), above {self.priced_context:,} "
                f"({CONTEXT_ABOVE:g}x the longest calibrated request: {self.context:,} tokens)"
            )
        return found

    def covers(self) -> str:
        """The setups, in a phrase: GPUs, models, tensor parallelism, precisions."""
        sizes: dict[str, list[str]] = {}
        for name in self.models:  # "Llama-3.1-8B" -> Llama-3.1: 8B
            family, _, size = name.rpartition("-")
            sizes.setdefault(family or name, []).append(size)
        models = ", ".join(f"{f} {'/'.join(sorted(s, key=_version_key))}" for f, s in sizes.items())
        held_only = [p for p in self.precisions if p not in self.fitted_precisions]
        return (
            f"{'/'.join(self.gpus)}; {models} ({_billions(self.params[0])}-"
            f"{_billions(self.params[1])} parameters); tp {_span(self.tps)}; requests up to "
            f"{self.context:,} tokens; "
            f"{'/'.join(self.fitted_precisions)}"
            + (f", {'/'.join(held_only)} held out only" if held_only else "")
        )

    def lines(self, precision: str) -> list[str]:
        """What a priced answer rests on, in two lines: the sources, the held-out error."""
        checked = len(self.fitted_on) + len(self.held_out)
        errors = self.errors.get(precision, {})
        shown = [f"{KIND_NAMES.get(k, k)} {e['mean_error']:.0%}" for k, e in errors.items()]
        if shown:
            shown[0] += " mean"
        fitted = precision in self.fitted_precisions
        which = "/".join(self.fitted_precisions) if fitted else f"{precision}, not fitted"
        which += f"; {self.error_sources.get(precision, 0)} sources"
        return [
            f"rests on: {checked} of {self.published} published engine benchmarks "
            f"({len(self.fitted_on)} fitted, {len(self.held_out)} held out: "
            f"{', '.join(self.engines)}) on {self.covers()}",
            f"held-out error ({which}): {', '.join(shown) or 'none measured'}",
        ]

    def report(self, precision: str, extrapolated: list[str]) -> dict[str, Any]:
        """The same facts for the JSON report (``simulated.calibration``)."""
        low, high = self.priced_params
        return {
            "summary": self.lines(precision),
            "published": self.published,
            "fitted_on": list(self.fitted_on),
            "held_out": list(self.held_out),
            "engines": list(self.engines),
            "covers": {
                "gpus": list(self.gpus),
                "models": list(self.models),
                "params_b": [round(n / 1e9, 3) for n in self.params],
                "priced_params_b": [round(low / 1e9, 3), round(high / 1e9, 3)],
                "tp": list(self.tps),
                "longest_request_tokens": self.context,
                "priced_request_tokens": self.priced_context,
                "precisions": list(self.precisions),
                "fitted_precisions": list(self.fitted_precisions),
            },
            "precision": precision,
            "held_out_error": self.errors.get(precision, {}),
            "held_out_error_sources": self.error_sources.get(precision, 0),
            "extrapolated": extrapolated,
        }


class OutsideCalibration(ValueError):
    """A GPU run far outside what the fitted terms were checked on: what, and how to go on."""

    def __init__(self, problems: list[str], cover: Coverage) -> None:
        self.problems = problems
        low, high = cover.priced_params
        listed = "".join(f"\n  - {p}" for p in problems)
        super().__init__(
            f"this run lies outside the GPU calibration:{listed}\nThe calibration covers "
            f"{cover.covers()}, and prices models of {_billions(low)}-{_billions(high)} "
            "parameters. Beyond it an answer is extrapolated, checked against no published "
            f"measurement: pass {ALLOW_FLAG} to price it anyway (the answer then warns)."
        )


@cache
def coverage() -> Coverage:
    """What the shipped calibration (``gpu_calibration.json``) rests on."""
    return Coverage.of(calibration(), load_sources())


def _hardware_key(name: str) -> str:
    """The ``HARDWARE`` key of a GPU's name (``H100-SXM`` -> ``H100``)."""
    exact = [key for key, hw in HARDWARE.items() if hw.name == name]
    return (exact or [k for k in HARDWARE if k.lower() in name.lower()] or [name])[0]


def _version_key(text: str) -> tuple[int, ...]:
    """Sorts "0.5" before "0.13.0" and "8B" before "70B"."""
    return tuple(int(n) for n in re.findall(r"\d+", text))


def _billions(params: float) -> str:
    return f"{params / 1e9:.3g}B"


def _span(values: tuple[int, ...]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
