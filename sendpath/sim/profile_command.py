"""`sendpath profile`: time this machine's engine, print the fit, write it for `sendpath sim`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sendpath.engine.args import add_engine_args, engine_config
from sendpath.sim.cost_model import Calibrated, ProfilePoint
from sendpath.sim.profile import DEFAULT_GRID, QUICK_GRID, profile
from sendpath.sim.profile_served import DEFAULT_SERVED, QUICK_SERVED, profile_served

__all__ = ["DEFAULT_OUT", "add_profile_args", "print_fit", "run_profile"]

DEFAULT_OUT = Path("sendpath-profile.json")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="FILE",
        help=f"where the fitted model goes (default: ./{DEFAULT_OUT})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny grid (seconds): checks the pipeline, too few points for a good fit",
    )
    p.add_argument(
        "--url",
        default=None,
        help="profile a running server instead (sendpath serve --replicas 1, or one replica): "
        "drive it with a grid of loads and fit the steps it ran, as served (engine flags "
        "are then the server's own)",
    )
    p.add_argument("--api-key", default=None, help="with --url: the gateway's API key")
    add_engine_args(p)


def run_profile(args: argparse.Namespace) -> int:
    """The `sendpath profile` command."""
    if args.url is not None:
        return _served(args)
    try:
        config = engine_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    span = "a quick grid" if args.quick else "about 2 minutes on 2 idle cores"
    print(f"sendpath profile: timing engine steps ({span})", flush=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(
            f"warning: load average {load:.1f}: something else is running; steps it slows "
            "are retaken, so this takes longer",
            flush=True,
        )
    cal = profile(config, grid, _progress)
    return _write(cal, args.out)


def _served(args: argparse.Namespace) -> int:
    grid = QUICK_SERVED if args.quick else DEFAULT_SERVED
    span = "a quick grid" if args.quick else "about 4 minutes with the built-in model on 2 cores"
    print(f"sendpath profile: loading {args.url} and reading its steps ({span})", flush=True)
    try:
        cal = profile_served(args.url, args.api_key, grid, _progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reference, drifted = cal.meta["reference"], cal.meta["drifted"]
    print(f"speed reference: {reference['median_s'] * 1e3:.0f} ms median over "
          f"{reference['times']} runs; taken again as the machine drifted: "
          f"{', '.join(cal.meta['retaken']) or 'none'}")  # fmt: skip
    if drifted:
        off = ", ".join(f"{label} (references took {ratio:.2f}x their median)"
                        for label, ratio in drifted)  # fmt: skip
        print(f"warning: kept though more than {grid.drift:.0%} off the usual speed: {off}")
    return _write(cal, args.out)


def _progress(p: ProfilePoint) -> None:
    print(f"  {p.label}: {p.seconds * 1e3:.1f} ms", flush=True)


def _write(cal: Calibrated, out: Path) -> int:
    print_fit(cal)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out)
    print(
        f"wrote {out} ({cal.model_name}, {cal.meta.get('dtype')}, {cal.device}; profiled in "
        f"{cal.meta['wall_s']:.0f} s). Use it: sendpath sim --cost-model {out} ..."
    )
    return 0


# the split model's terms as `sendpath profile` prints them: name, scale, format, unit
SPLIT_TERMS = (
    ("step", 1e3, ".2f", "ms a step"),
    ("prompt", 1e3, ".3f", "ms a prompt token"),
    ("prefilling", 1e3, ".2f", "ms a step with prefill chunks"),
    ("prefill", 1e3, ".2f", "ms a chunk"),
    ("resume", 1e3, ".2f", "ms more if it resumes past position 0"),
    ("context", 1e9, ".1f", "ns a context token attended"),
    ("kv", 1e6, ".2f", "us a KV token gathered"),
    ("ride", 1e3, ".3f", "ms a decode beside a prefill"),
    ("riding", 1e3, ".2f", "ms a step with decodes beside a prefill"),
)


def print_fit(cal: Calibrated) -> None:
    """The measured vs fitted table, the coefficients and the fit's errors."""
    print(f"\nstep time, measured vs fitted: {cal.model_name} ({cal.meta.get('dtype')}, "
          f"{cal.device})")  # fmt: skip
    print(f"{'point':<34}{'tokens':>7}{'seqs':>6}{'context':>9}{'kv':>7}"
          f"{'measured ms':>13}{'fitted ms':>11}{'error':>8}")  # fmt: skip
    for p, held_out in zip(cal.points, cal.held_out, strict=True):
        fitted, s = cal.step_seconds(p.shape), p.shape
        label = p.label + (" (held out)" if held_out else "")
        print(f"{label:<34}{s.num_tokens:>7}{s.num_seqs:>6}{s.context_tokens:>9}"
              f"{s.kv_tokens:>7}{p.seconds * 1e3:>13.1f}{fitted * 1e3:>11.1f}"
              f"{(fitted - p.seconds) / p.seconds:>+8.1%}")  # fmt: skip
    c = cal.coefficients
    if cal.seq_knots:
        bends = ", ".join(f"{k}: {c[f'seqs@{k}'] * 1e3:.1f}" for k in cal.seq_knots[1:])
        per_seq = f"per-sequence ms by batch size (1: 0, {bends})"
    else:
        per_seq = f"{c['seq'] * 1e3:.3f} ms a sequence"
    if cal.split:
        off = cal.unfitted
        if off:  # its price is in another term's: say so, not "0.00 ms"
            print(f"not fitted (the grid cannot tell them apart from other terms): "
                  f"{', '.join(sorted(off))}")  # fmt: skip
        terms = " + ".join(
            f"{'n/a' if name in off else format(c[name] * scale, spec)} {what}"
            for name, scale, spec, what in SPLIT_TERMS
        )
        print(f"fitted: {terms}; decode-only steps: {per_seq}")
    else:
        print(
            f"fitted: {c['step'] * 1e3:.2f} ms a step + {c['token'] * 1e3:.3f} ms a token + "
            f"{c['context'] * 1e9:.1f} ns a context token attended + {c['kv'] * 1e6:.2f} us a "
            f"KV token read + {per_seq}"
        )
    for name, err in (("fit points", cal.error()), ("held-out mixed steps", cal.error(True))):
        if err is not None:
            print(f"relative error on {err.count} {name}: max {err.max:.1%}, mean {err.mean:.1%}")
    for key, why in (("skipped", "do not fit this engine"), ("noisy", "machine busy")):
        if cal.meta.get(key):
            print(f"{key} ({why}): {', '.join(cal.meta[key])}")
