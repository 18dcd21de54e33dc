"""`sendpath profile`: fit this machine's engine steps, print the fit, write it for `sim`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sendpath.engine.args import add_engine_args, engine_config
from sendpath.sim.calibrated import Calibrated, PointKind, ProfilePoint
from sendpath.sim.profile import DEFAULT_GRID, QUICK_GRID, profile, profile_served

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_profile_args", "print_fit", "register", "run_profile"]

DEFAULT_OUT = Path("sendpath-profile.json")
DESCRIPTION = (
    "Serve the engine `sendpath replica` would run with the same flags (the built-in "
    "SmolLM2-135M by default) in this process, send it a grid of loads, fit each step's time "
    "in the engine's own step log to the step's shape (the terms: sendpath/sim/calibrated.py), "
    "print measured vs fitted and write the fit as JSON for `sendpath sim --cost-model`. With "
    "--url, send the same loads to a running server and fit the steps it logs (GET /v1/steps). "
    "About 2 minutes on 2 CPU cores. Profile on an idle machine: nothing checks for other "
    "processes, and one that shares the cores slows every step it overlaps, which the fit "
    "then takes for the engine's own cost."
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `profile` subcommand: its flags, and ``run_profile`` as its handler."""
    prof = sub.add_parser("profile", help=help, description=DESCRIPTION)
    add_profile_args(prof)
    prof.set_defaults(handler=run_profile)


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
            print(
                "sendpath profile: serving the engine in this process, sending it loads", flush=True
            )
            cal = profile(config, grid, _progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sendpath profile: interrupted; nothing written", file=sys.stderr)
        return 130
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
    row = "{:>7}{:>6}{:>9}{:>7}{:>13}{:>11}{:>8}  {}".format  # the label last: any length
    print(row("tokens", "seqs", "context", "kv", "measured ms", "fitted ms", "error", "point"))
    for p in cal.points:
        s, fitted, ms = p.shape, cal.step_seconds(p.shape), p.seconds * 1e3
        error = f"{(fitted - p.seconds) / p.seconds:+.1%}"
        sizes = (s.num_tokens, s.num_seqs, s.context_tokens, s.kv_tokens)
        print(row(*sizes, f"{ms:.1f}", f"{fitted * 1e3:.1f}", error, p.label))
    terms = ", ".join(f"{t} {c * 1e3:.3g}" for t, c in cal.coefficients.items())
    print(f"fitted, in ms (the terms: sendpath/sim/calibrated.py): {terms}")
    for kind in PointKind:
        if (e := cal.error(kind)) is not None:
            print(f"relative error on {e.count} {kind} points: max {e.max:.1%}, mean {e.mean:.1%}")
    if cal.meta.get("skipped"):
        print(f"skipped (do not fit this engine): {', '.join(cal.meta['skipped'])}")
