"""`sendpath profile`: fit this machine's engine steps, print the fit, write it for `sim`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sendpath.engine.args import add_engine_args, engine_config
from sendpath.sim.calibrated import Calibrated, ProfilePoint
from sendpath.sim.profile import DEFAULT_GRID, QUICK_GRID, profile
from sendpath.sim.profile_served import profile_served

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_profile_args", "print_fit", "run_profile"]

DEFAULT_OUT = Path("sendpath-profile.json")
DESCRIPTION = (
    "Run the engine `sendpath replica` would run with the same flags (the built-in "
    "SmolLM2-135M by default) through a grid of loads, fit each step's time in the engine's "
    "own step log to the step's shape (the terms: sendpath/sim/calibrated.py), print measured "
    "vs fitted and write the fit as JSON for `sendpath sim --cost-model`. With --url, send the "
    "same loads to a running server and fit the steps it logs (GET /v1/steps), as served. "
    "About 2 minutes on 2 CPU cores. Profile on an idle machine: nothing checks for other "
    "processes, and one that shares the cores slows every step it overlaps, which the fit "
    "then takes for the engine's own cost."
)


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
        help="profile a running server instead (sendpath serve --replicas 1, or one replica) "
        "from its own step log, as served (engine flags are then the server's own)",
    )
    p.add_argument("--api-key", default=None, help="with --url: the gateway's API key")
    p.add_argument(
        "--replica-api-key",
        default=os.environ.get("SENDPATH_REPLICA_API_KEY"),
        help="with --url: the key the replica wants for its step log, as given to "
        "`sendpath serve` (default: $SENDPATH_REPLICA_API_KEY)",
    )
    add_engine_args(p)


def run_profile(args: argparse.Namespace) -> int:
    """The `sendpath profile` command."""
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    try:
        if args.url is not None:
            print(f"sendpath profile: loading {args.url} and reading its steps", flush=True)
            cal = profile_served(args.url, args.api_key, grid, _progress, args.replica_api_key)
        else:
            config = engine_config(args)
            print("sendpath profile: running loads on the engine", flush=True)
            cal = profile(config, grid, _progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_fit(cal)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(args.out)
    about = f"{cal.model_name}, {cal.meta.get('dtype')}, {cal.device}"
    print(f"wrote {args.out} ({about}). Use it: sendpath sim --cost-model {args.out} ...")
    return 0


def _progress(p: ProfilePoint) -> None:
    print(f"  {p.label}: {p.seconds * 1e3:.1f} ms", flush=True)


def print_fit(cal: Calibrated) -> None:
    """The measured vs fitted table, the coefficients and the fit's errors."""
    print(
        f"\nstep time, measured vs fitted: {cal.model_name} ({cal.meta.get('dtype')}, {cal.device})"
    )
    columns = "{:<34}{:>7}{:>6}{:>9}{:>7}{:>13}{:>11}{:>8}"
    print(
        columns.format(
            "point", "tokens", "seqs", "context", "kv", "measured ms", "fitted ms", "error"
        )
    )
    for p, held_out in zip(cal.points, cal.held_out, strict=True):
        fitted, s = cal.step_seconds(p.shape), p.shape
        print(
            columns.format(
                p.label + (" (held out)" if held_out else ""),
                s.num_tokens,
                s.num_seqs,
                s.context_tokens,
                s.kv_tokens,
                f"{p.seconds * 1e3:.1f}",
                f"{fitted * 1e3:.1f}",
                f"{(fitted - p.seconds) / p.seconds:+.1%}",
            )
        )
    terms = ", ".join(f"{t} {cal.coefficients[t] * 1e3:.3g}" for t in cal.terms)
    print(f"fitted, in ms (the terms: sendpath/sim/calibrated.py): {terms}")
    for name, err in (("fit points", cal.error()), ("held-out mixed steps", cal.error(True))):
        if err is not None:
            print(f"relative error on {err.count} {name}: max {err.max:.1%}, mean {err.mean:.1%}")
    if cal.meta.get("skipped"):
        print(f"skipped (do not fit this engine): {', '.join(cal.meta['skipped'])}")
