"""`sendpath sim`: the seed's scenarios, or any traffic, on simulated GPUs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from sendpath.bench.command import print_report
from sendpath.bench.workload import LengthSpec
from sendpath.config import SchedulerConfig
from sendpath.extras import require
from sendpath.router.policy import POLICIES
from sendpath.sim.calibrated import Calibrated
from sendpath.sim.capacity import plan
from sendpath.sim.compiled import how
from sendpath.sim.coverage import CONTEXT_ABOVE, MODEL_ABOVE, MODEL_BELOW
from sendpath.sim.gpu_model import PRECISION_BYTES
from sendpath.sim.hardware import HARDWARE, MODELS
from sendpath.sim.scenarios import SCENARIOS, Run, simulate
from sendpath.sim.simulator import MODES
from sendpath.sim.traffic import PATTERNS

__all__ = ["add_sim_args", "register", "run_sim"]


def _any_case(names: Iterable[str]) -> Callable[[str], str]:
    """An argparse type that takes a choice in any case (``h100`` is ``H100``)."""
    by_lower = {name.lower(): name for name in names}
    return lambda value: by_lower.get(value.lower(), value)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `sim` subcommand: its flags, and ``run_sim`` as its handler."""
    sim = sub.add_parser(
        "sim",
        help=help,
        description="Run our scheduler, KV cache and router on a virtual clock with a "
        "roofline cost model, or with step times measured on this machine (--cost-model, "
        "from `sendpath profile`): the seed's scenarios (--scenario), or any traffic on any "
        "number of replicas. Reports what `sendpath bench` reports, plus utilisation and cost.",
    )
    add_sim_args(sim)
    sim.set_defaults(handler=run_sim)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        nargs="?",
        choices=["run", "plan"],
        default="run",
        help="run (default) the traffic, or plan: the fewest replicas that meet the SLOs",
    )
    p.add_argument("--slo-ttft-p99-ms", type=float, default=None, help="plan: TTFT p99 target")
    p.add_argument("--slo-tpot-p99-ms", type=float, default=None, help="plan: TPOT p99 target")
    p.add_argument("--scenario", choices=list(SCENARIOS), default=None)
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="arrivals per second (the mean, whatever the --pattern)",
    )
    p.add_argument("--requests", type=int, default=None, help="requests in all")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="a closed loop instead of arrivals: N clients, each sending its next request as "
        "its answer ends (`vllm bench serve --max-concurrency N` with every request ready; "
        "--rate and --pattern are then not used)",
    )
    p.add_argument("--input-len", default=None, help="tokens: N or LOW-HIGH")
    p.add_argument("--output-len", default=None, help="tokens: N or LOW-HIGH")
    p.add_argument("--shared-prefix", type=int, default=None, help="system-prompt tokens")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation")
    p.add_argument("--think", type=float, default=None, help="mean seconds between turns")
    p.add_argument(
        "--pattern",
        choices=PATTERNS,
        default=None,
        help="arrivals: poisson, bursty, or diurnal (a day's rise and fall); default: the "
        f"scenario's ({QUIET.pattern})",
    )
    p.add_argument(
        "--period",
        type=float,
        default=None,
        help=f"diurnal: seconds in one day (default {QUIET.period_s:g})",
    )
    p.add_argument(
        "--peak-ratio",
        type=float,
        default=None,
        help=f"diurnal: busiest rate / quietest rate (default {QUIET.peak_ratio:g})",
    )
    p.add_argument("--tenants", type=int, default=None, help="API keys sharing the traffic")
    p.add_argument(
        "--tpm",
        type=int,
        default=None,
        help="gateway limit per tenant: tokens per minute (prompt + max_tokens)",
    )
    p.add_argument(
        "--rpm", type=int, default=None, help="gateway limit per tenant: requests per minute"
    )
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument(
        "--hardware",
        type=_any_case(HARDWARE),
        choices=list(HARDWARE),
        default=None,
        help="default: H100 (any case)",
    )
    p.add_argument(
        "--model",
        type=_any_case(MODELS),
        choices=list(MODELS),
        default=None,
        help="default: llama-3.1-8b (any case)",
    )
    p.add_argument("--tp", type=int, default=None, help="tensor parallelism per replica")
    p.add_argument(
        "--precision",
        choices=list(PRECISION_BYTES),
        default="bf16",
        help="a GPU's weights (default bf16; the KV cache stays bf16): fp8 needs fp8 tensor "
        f"cores ({', '.join(k for k, hw in HARDWARE.items() if hw.fp8_flops)}) and was only "
        "held out of the fit, never fitted: its error is larger (printed with the answer)",
    )
    p.add_argument(
        "--allow-extrapolation",
        action="store_true",
        help="price a GPU run outside what the fitted step terms rest on, with a warning in "
        "the answer. Without it, such a run is refused: a GPU no published source measured, "
        f"a model below {MODEL_BELOW:g}x the smallest or above {MODEL_ABOVE:g}x the largest "
        "source model's parameters, tensor parallelism above the largest a source ran, a "
        "precision none ran, or a request (shared prefix and every turn) above "
        f"{CONTEXT_ABOVE:g}x the longest a source ran (the ranges come from "
        "sendpath/sim/gpu_sources/ and gpu_calibration.json; the refusal says them). The "
        "cpu entry and --cost-model are not checked",
    )
    p.add_argument("--policy", choices=list(POLICIES), default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-hour-usd", type=float, default=None, help="default: the table's")
    p.add_argument(
        "--cost-model",
        default=None,
        metavar="FILE",
        help="step times fitted by `sendpath profile` on a real engine, instead of the "
        "roofline (the model, device, KV blocks and batch limits come from the file; from "
        "a served profile, --url, also the request overhead as the network round trip and "
        "the output filter's hold on first tokens)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="fleet",
        help="fleet (default): decoding requests advanced by a step counter, the "
        "scheduler for the rest; detailed: the scheduler every step with every request "
        "(the reference: the same answers, 3-4x slower)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, metavar="FILE")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="stage chart (needs the plot extra: pip install 'sendpath[plot]')",
    )


QUIET = SCENARIOS["quiet"].traffic  # what a run without --scenario starts from


def build_run(args: argparse.Namespace) -> Run:
    """The run the flags describe: a scenario (or the quiet one) with flags overriding."""
    base = SCENARIOS[args.scenario or "quiet"]
    t, c = base.traffic, base.config
    traffic = replace(
        t,
        rate=args.rate if args.rate is not None else t.rate,
        num_requests=args.requests if args.requests is not None else t.num_requests,
        input_len=LengthSpec.parse(args.input_len) if args.input_len else t.input_len,
        output_len=LengthSpec.parse(args.output_len) if args.output_len else t.output_len,
        shared_prefix=args.shared_prefix if args.shared_prefix is not None else t.shared_prefix,
        turns=args.turns if args.turns is not None else t.turns,
        think_s=args.think if args.think is not None else t.think_s,
        seed=args.seed if args.seed is not None else t.seed,
        pattern=args.pattern or t.pattern,
        period_s=args.period if args.period is not None else t.period_s,
        peak_ratio=args.peak_ratio if args.peak_ratio is not None else t.peak_ratio,
        tenants=args.tenants if args.tenants is not None else t.tenants,
        concurrency=args.max_concurrency,
    )
    if args.cost_model is not None:
        calibrated = Calibrated.load(args.cost_model)
        try:  # the profiled engine's KV cache and limits, a served profile's time outside steps
            c = calibrated.sim_config(c)
        except ValueError as exc:
            raise ValueError(f"{args.cost_model}: {exc}") from None
    sched = c.scheduler
    config = replace(
        c,
        replicas=args.replicas if args.replicas is not None else c.replicas,
        policy=args.policy or c.policy,
        mode=args.mode,
        tpm=args.tpm,
        rpm=args.rpm,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs or sched.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or sched.max_num_batched_tokens,
            max_queued_requests=sched.max_queued_requests,
        ),
    )
    return Run(
        traffic,
        config,
        args.hardware or base.hardware,
        args.model or base.model,
        args.tp or base.tp,
        args.gpu_hour_usd,
        args.cost_model,
        args.precision,
        args.allow_extrapolation or base.allow_extrapolation,
    )


def run_sim(args: argparse.Namespace) -> int:
    """The `sendpath sim` command."""
    if args.action == "plan":
        return _plan(args)
    if args.plot is not None:
        require("plot")
    try:
        run = build_run(args)
        start = time.perf_counter()
        result, report = simulate(run)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - start
    report["simulated"]["wall_s"] = wall
    report["simulated"]["requests_per_wall_s"] = len(result.results) / wall if wall else None
    report["simulated"]["simulator"] = how()
    report["scenario"] = args.scenario
    console = Console()
    s = report["simulated"]
    print_report(report, console, title=f"sendpath sim: {s['model']} on {s['replicas']} x "
                 f"{s['tp']} x {s['hardware']} ({s['policy']})")  # fmt: skip
    _print_fleet(s, console)
    for line in _calibration_lines(s):
        console.print(line, markup=False, highlight=False)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        from sendpath.bench.plot import plot_stages

        plot_stages(report, args.plot)
    return 0


def _shares(values: list[float]) -> str:
    """Per-replica shares: each of a few, or the spread of many (a fleet of 128)."""
    if len(values) <= 8:
        return ", ".join(f"{v:.0%}" for v in values)
    mean = sum(values) / len(values)
    return f"{mean:.0%} mean over {len(values)} replicas ({min(values):.0%}-{max(values):.0%})"


def _print_fleet(s: dict[str, Any], console: Console) -> None:
    per_m = s["usd_per_1m_output_tokens"]
    console.print(
        f"busy: {_shares(s['utilization'])}; KV peak: {_shares(s['kv_peak_usage'])}; "
        f"{s['gpu_hours']:.4f} GPU-hours, ${s['cost_usd']:.4f}"
        + (f", ${per_m:.3f} per 1M output tokens" if per_m else "")
        + (f"; {s['rate_limited']} over their tenant's limits (429)" if s["rate_limited"] else "")
        + (f"; {s['rejected']} turned away by full queues (503)" if s["rejected"] else "")
        + f"; simulated {s['steps']:,} steps in {s['wall_s']:.2f} s ({s['mode']} mode, "
        f"{escape(s['simulator'])})"  # a build's error can hold [brackets]
    )


def _calibration_lines(s: dict[str, Any]) -> list[str]:
    """What a GPU answer rests on, and a warning for each thing it extrapolates."""
    cal = s["calibration"]
    if cal is None:  # the cpu roofline or a profiled cost model: their own calibration
        return []
    warning = "warning: extrapolated, checked against no published measurement: "
    return [*(warning + what for what in cal["extrapolated"]), *cal["summary"]]


def _plan(args: argparse.Namespace) -> int:
    if args.slo_ttft_p99_ms is None or args.slo_tpot_p99_ms is None:
        print("error: sim plan needs --slo-ttft-p99-ms and --slo-tpot-p99-ms", file=sys.stderr)
        return 2
    try:
        found = plan(build_run(args), args.slo_ttft_p99_ms, args.slo_tpot_p99_ms)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r, s = found.report, found.report["simulated"]
    tried = ", ".join(
        f"{n}: {'meets' if ok else 'misses'}" for n, ok in sorted(found.tried.items())
    )
    per_m = s["usd_per_1m_output_tokens"]
    print(
        f"{found.replicas} replica(s) of {s['tp']} x {s['hardware']} serving {s['model']} meet "
        f"p99 TTFT <= {args.slo_ttft_p99_ms:g} ms (got {r['p99_ttft_ms']:.0f}) and p99 TPOT <= "
        f"{args.slo_tpot_p99_ms:g} ms (got {r['p99_tpot_ms']:.1f}) at "
        f"{build_run(args).traffic.rate:g} requests/s"
        + (f"; ${per_m:.3f} per 1M output tokens" if per_m else "")
        + f". Tried {tried}."
    )
    for line in _calibration_lines(s):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"replicas": found.replicas, **r}, indent=2) + "\n")
    return 0
