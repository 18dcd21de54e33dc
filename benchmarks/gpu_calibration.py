"""The GPU step model against published measurements: fit on some sources, predict the rest.

Every source file in ``sendpath/sim/gpu_sources/`` (published engine benchmarks with their
setup and figures, ``sendpath/sim/gpu_sources.py``) is replayed by the simulator
(``sendpath/sim/gpu_fit.py``). The sources are split by name: every ``--hold-every``-th
one (sorted) is held out, the rest fit the efficiency terms (``sendpath/sim/gpu_model.py``)
by a deterministic coordinate search (bf16 and fp16 sources only unless
``--fit-precisions`` says otherwise). Reported for every figure: published, predicted with
the fitted terms, predicted with the plain roofline's shares (the terms' defaults), and the
relative errors; the summary gives the held-out mean error by kind of figure.

    python -m benchmarks.gpu_calibration                      # ~12 minutes on 2 Zen 4 cores
    python -m benchmarks.gpu_calibration --max-requests 100   # quicker, coarser

The replays run on the compiled simulator (``sendpath/sim/compiled.py``, as `sendpath sim`
does; ``SENDPATH_SIM_COMPILED=0`` for Python, the same figures to the last digit), in
worker processes that make the cases themselves (compiled objects do not pickle).

Results: ``benchmarks/results/gpu_calibration.json`` and the fitted terms, with the
sources and held-out errors they rest on, in ``sendpath/sim/gpu_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from sendpath.sim.compiled import use

HOW = use(lambda message: print(message, file=sys.stderr, flush=True))  # before the sim's imports

from sendpath.sim.gpu_fit import Case, Mapper, cases, fit, predict  # noqa: E402
from sendpath.sim.gpu_model import Efficiency  # noqa: E402
from sendpath.sim.gpu_sources import SOURCES, load_sources  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_calibration.json"
CALIBRATION = SOURCES.parent / "gpu_calibration.json"
KINDS = {"throughput": "throughput", "tpot": "tpot", "ttft": "ttft", "itl": "tpot", "e2e": "e2e"}


_CASES: dict[str, Case] = {}  # a worker's cases by name, made by its initializer


def _load_cases(max_requests: int) -> None:
    """A worker makes the cases itself: the compiled simulator's objects do not pickle."""
    _CASES.update((c.name, c) for c in cases(load_sources(), max_requests)[0])


def _on_named(run: Callable[[Case], float], name: str) -> float:
    return run(_CASES[name])


def by_name(pool: ProcessPoolExecutor) -> Mapper:
    """``pool.map`` that sends each worker a case's name, not the case."""

    def mapper(run: Callable[[Case], float], found: Sequence[Case]) -> Iterable[float]:
        return pool.map(partial(_on_named, run), [c.name for c in found])

    return mapper


def kind(figure: str) -> str:
    """throughput, tpot (and inter-token latency), ttft or e2e."""
    return next(v for k, v in KINDS.items() if k in figure)


def rows(found: list[Case], eff: Efficiency, held: set[str]) -> list[dict[str, Any]]:
    out = []
    for c in found:
        fitted, plain = predict(c, eff), predict(c, Efficiency())
        for figure, published in c.measurement.figures.items():
            out.append(
                {
                    "case": c.name,
                    "held_out": c.source.name in held,
                    "engine": f"{c.source.engine} {c.source.engine_version}",
                    "setup": f"{c.model.name} {c.source.setup.precision} on "
                    f"{c.source.setup.gpu_count} x {c.hw.name}, tp {c.source.setup.tp}",
                    "limits": c.limits,
                    "workload": asdict(c.measurement.workload),
                    "figure": figure,
                    "published": published,
                    "predicted": round(fitted[figure], 3),
                    "error": round(abs(fitted[figure] - published) / published, 4),
                    "roofline": round(plain[figure], 3),
                    "roofline_error": round(abs(plain[figure] - published) / published, 4),
                }
            )
    return out


def summary(table: list[dict[str, Any]], held_out: bool, fp8: bool | None = None) -> dict[str, Any]:
    """Count, mean and max error by kind of figure, held out or fitted on (``fp8``: only
    the fp8 sources' figures, or only the others')."""
    out: dict[str, Any] = {}
    for k in sorted({kind(r["figure"]) for r in table}):
        rows = [
            r
            for r in table
            if r["held_out"] == held_out
            and kind(r["figure"]) == k
            and (fp8 is None or (" fp8 " in r["setup"]) == fp8)
        ]
        errs = [r["error"] for r in rows]
        plain = [r["roofline_error"] for r in rows]
        if errs:
            out[k] = {
                "figures": len(errs),
                "mean_error": round(statistics.fmean(errs), 4),
                "max_error": round(max(errs), 4),
                "roofline_mean_error": round(statistics.fmean(plain), 4),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-every", type=int, default=3, help="hold out every Nth source")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=500,
        help="a replay's most (default 500: TensorRT-LLM's online runs whole, with the "
        "engines' own batch limits)",
    )
    parser.add_argument("--sweeps", type=int, default=2, help="of the coordinate search")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="replays at once")
    parser.add_argument(
        "--fit-precisions",
        default="bf16,fp16",
        help="the weights' precisions fitted (default bf16,fp16: the fp8 sources' engines "
        "keep an fp8 KV cache and fp8 attention, which the model does not price)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    sources = load_sources()
    names = [s.name for s in sources]
    held = {n for i, n in enumerate(names) if i % args.hold_every == args.hold_every - 1}
    found, skipped = cases(sources, args.max_requests)
    if len({c.name for c in found}) < len(found):  # the workers find cases by name
        raise SystemExit("two measurements share a name (source/id): give each its own id")
    fitting = set(args.fit_precisions.split(","))
    train = [c for c in found if c.source.name not in held and c.source.setup.precision in fitting]
    print(f"{len(sources)} sources, {len(found)} replayable measurements, {len(skipped)} not")
    print(f"fitting on {len(train)} measurements ({args.fit_precisions})", flush=True)
    began = time.perf_counter()
    with ProcessPoolExecutor(args.processes, initializer=_load_cases,
                             initargs=(args.max_requests,)) as pool:  # fmt: skip
        eff, train_error = fit(
            train,
            sweeps=args.sweeps,
            progress=lambda e, err: print(f"  {err:.3f} {asdict(e)}", flush=True),
            mapper=by_name(pool),
        )
    print(f"fitted in {time.perf_counter() - began:.0f} s: {asdict(eff)}")
    table = rows(found, eff, held)
    for r in table:
        mark = "held out" if r["held_out"] else "fit"
        errs = f"{r['error']:.0%}; roofline {r['roofline_error']:.0%}"
        print(f"{mark:8} {r['case']:55} {r['figure']:24} published {r['published']:>10} "
              f"predicted {r['predicted']:>10} ({errs})")  # fmt: skip
    result = {
        "efficiency": asdict(eff),
        "train_mean_error": round(train_error, 4),
        "fit_precisions": args.fit_precisions,
        "held_out": sorted(held),
        "held_out_summary": summary(table, True),
        "held_out_bf16_fp16": summary(table, True, fp8=False),
        "held_out_fp8": summary(table, True, fp8=True),
        "fit_summary": summary(table, False),
        "skipped": [{"case": n, "why": why} for n, why in skipped],
        "max_requests": args.max_requests,
        "simulator": HOW,
        "rows": table,
    }
    print("held out:", json.dumps(result["held_out_summary"]))
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    calibration = {
        "efficiency": asdict(eff),
        "fit_precisions": args.fit_precisions,
        "sources": {s.name: s.citation for s in sources},
        "fitted_on": sorted({c.source.name for c in train}),
        "held_out": sorted(held),
        "held_out_error": result["held_out_bf16_fp16"],  # what plans rest on: bf16 / fp16
        "held_out_error_fp8": result["held_out_fp8"],
        "models": sorted({c.model.name for c in found}),
        "gpus": sorted({c.hw.name for c in found}),
    }
    CALIBRATION.write_text(json.dumps(calibration, indent=1) + "\n")


if __name__ == "__main__":
    main()
