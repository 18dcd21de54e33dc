"""`sendpath bench`: load any OpenAI-compatible server and report as `vllm bench serve`.

``--scenario`` picks one of the seed's three situations (flags given explicitly win):
- ``quiet``: one user at a time, a short question, a long answer: decode should dominate.
- ``overloaded``: a short probe measures the server's capacity, then requests arrive at
  twice that for long enough that the queue dominates (`sendpath.bench.overload`; a
  ``--rate`` given skips the probe and offers that instead).
- ``long-document``: a ~1,500-token pasted document, a short answer: prefill shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sendpath.bench.overload import OverloadPlan, ProbeLevel, plan, probe
from sendpath.bench.report import GOODPUT_METRICS, dominant, summarize
from sendpath.bench.runner import Load, run
from sendpath.bench.workload import DATASETS, LengthSpec, build
from sendpath.extras import require

__all__ = ["SCENARIOS", "add_bench_args", "print_report", "register", "run_bench", "served_model"]

SCENARIOS: dict[str, dict[str, Any]] = {
    "quiet": {"dataset": "random", "concurrency": 1, "num_requests": 6,
              "input_len": "32", "output_len": "128"},
    "overloaded": {"dataset": "random", "input_len": "64", "output_len": "16"},
    "long-document": {"dataset": "long-document", "concurrency": 1, "num_requests": 3,
                      "input_len": "1500", "output_len": "32"},
}  # fmt: skip
DEFAULTS: dict[str, Any] = {
    "dataset": "random", "num_requests": 100, "input_len": "128", "output_len": "128",
}  # fmt: skip


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `bench` subcommand: its flags, and ``run_bench`` as its handler."""
    bench = sub.add_parser(
        "bench",
        help=help,
        description="A load generator for any OpenAI-compatible server (sendpath, vLLM, "
        "llama.cpp): TTFT, TPOT, ITL, E2EL, throughput, goodput, and the stage breakdown "
        "when the server reports one. --scenario runs the seed's three situations.",
    )
    add_bench_args(bench)
    bench.set_defaults(handler=run_bench)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="default: %(default)s")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SENDPATH_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $SENDPATH_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--scenario", choices=list(SCENARIOS), default=None)
    p.add_argument(
        "--dataset", choices=DATASETS, default=None, help=f"default: {DEFAULTS['dataset']}"
    )
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (cap)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (--scenario overloaded: twice the probed capacity)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"default: {DEFAULTS['num_requests']} (--scenario overloaded: sized from the probe)",
    )
    for side in ("input", "output"):
        default = DEFAULTS[f"{side}_len"]
        p.add_argument(f"--{side}-len", default=None, help=f"tokens: N or LOW-HIGH ({default})")
    p.add_argument("--turns", type=int, default=4, help="turns per shared-prefix conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="let answers stop early (ignore_eos off)"
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="stage chart (needs the plot extra: pip install 'sendpath[plot]')",
    )


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    preset = SCENARIOS.get(args.scenario or "", {})
    out = {}
    for name in ("dataset", "concurrency", "rate", "num_requests", "input_len", "output_len"):
        given = getattr(args, name)
        out[name] = given if given is not None else preset.get(name, DEFAULTS.get(name))
    if out["concurrency"] is None and out["rate"] is None and not _probing(args):
        out["concurrency"] = 1
    return out


def _probing(args: argparse.Namespace) -> bool:
    """The overloaded scenario sizes its load from a capacity probe unless --rate is given."""
    return bool(args.scenario == "overloaded" and args.rate is None)


def _goodput(specs: list[str] | None) -> dict[str, float] | None:
    if not specs:
        return None
    out = {}
    for spec in specs:
        name, _, ms = spec.partition(":")
        if name not in GOODPUT_METRICS or not ms:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}: {spec!r}")
        out[name] = float(ms)
    return out


async def served_model(url: str, api_key: str | None) -> str:
    """The first model id the server lists (what a request names by default)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=30) as client:
        r = await client.get("/v1/models", headers=headers)
    if r.status_code != 200:
        raise ValueError(f"GET /v1/models said {r.status_code}: {r.text[:300]}")
    model: str = r.json()["data"][0]["id"]
    return model


def run_bench(args: argparse.Namespace) -> int:
    """The `sendpath bench` command."""
    console = Console(stderr=True)
    if args.plot is not None:
        require("plot")
    extra: dict[str, object] = {"temperature": 0.0}
    if not args.no_ignore_eos:
        extra["ignore_eos"] = True
    overload: OverloadPlan | None = None
    try:
        s = _settings(args)
        slos = _goodput(args.goodput)
        input_len = LengthSpec.parse(str(s["input_len"]))
        output_len = LengthSpec.parse(str(s["output_len"]))
        model = args.model or asyncio.run(served_model(args.url, args.api_key))
        if _probing(args):
            overload = _size_overload(args, model, input_len, output_len, extra, console)
            s["rate"], s["num_requests"] = overload.offered_rps, overload.num_requests
        load = Load(s["concurrency"], s["rate"], args.seed)
        conversations = build(
            s["dataset"], s["num_requests"], input_len, output_len, args.seed, args.turns
        )
    except (ValueError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{s['dataset']} x {s['num_requests']}", total=s["num_requests"])
        results, duration = asyncio.run(
            run(args.url, model, conversations, load, args.api_key, extra,
                lambda r: progress.advance(task))
        )  # fmt: skip
    report = summarize(results, duration, slos)
    report.update(
        model=model,
        scenario=args.scenario,
        dataset=s["dataset"],
        max_concurrency=s["concurrency"],
        request_rate=s["rate"] if s["rate"] is not None else "inf",
    )
    if overload is not None:
        report["overload"] = overload.report()
    found = dominant(report["stages"])
    if found is not None:
        report["dominant_stage"] = found[0]
    print_report(report, Console())
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        from sendpath.bench.plot import plot_stages

        plot_stages(report, args.plot)
    return 0 if report["completed"] else 1


def _size_overload(
    args: argparse.Namespace,
    model: str,
    input_len: LengthSpec,
    output_len: LengthSpec,
    extra: dict[str, object],
    console: Console,
) -> OverloadPlan:
    """Probe the server's capacity with the scenario's requests; the load twice that."""

    def show(level: ProbeLevel) -> None:
        refused = f", {level.refused} refused: saturated" if level.refused else ""
        console.print(
            f"capacity probe: {level.concurrency} requests at once -> "
            f"{level.requests_per_s:.2f} requests/s (median {level.median_latency_s:.1f} s)"
            + refused
        )

    console.print(
        "capacity probe: one warm-up request, then bursts of 4, 8, 16, ... requests at once "
        "until the throughput stops rising"
    )
    levels = asyncio.run(probe(args.url, model, input_len, output_len, args.api_key, extra, show))
    return plan(levels, args.num_requests, _admitted(args.url, args.api_key))


def _admitted(url: str, api_key: str | None) -> int | None:
    """How many requests a sendpath gateway forwards at once (its ``/fleet``'s capacity);
    ``None`` from any other server."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        found = httpx.get(f"{url.rstrip('/')}/fleet", headers=headers, timeout=5).json()
        capacity = found["gateway"]["capacity"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    good = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0
    return capacity if good else None


def print_report(report: dict[str, Any], console: Console, title: str = "sendpath bench") -> None:
    """The summary table, the stage table and the dominant stage."""
    table = Table(title=title, title_justify="left", box=None)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if "overload" in report:
        console.print(report["overload"]["summary"])
    rows = [
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration s", f"{report['duration']:.2f}"),
        ("request throughput /s", f"{report['request_throughput']:.3f}"),
        ("output tokens /s", f"{report['output_throughput']:.1f}"),
        ("total tokens /s", f"{report['total_token_throughput']:.1f}"),
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows.append(
            (
                f"{name.upper()} ms mean / median / p99",
                f"{report[f'mean_{name}_ms']:.1f} / {report[f'median_{name}_ms']:.1f} / "
                f"{report[f'p99_{name}_ms']:.1f}",
            )
        )
    if "request_goodput" in report:
        rows.append(("goodput req/s", f"{report['request_goodput']:.3f}"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for error in report["errors"]:
        console.print(f"[red]error:[/red] {error}")
    stages = report["stages"]
    if not stages:
        console.print("[dim]the server reported no stage timings[/dim]")
        return
    st = Table(title="where the time went (mean per request)", title_justify="left", box=None)
    st.add_column("stage")
    st.add_column("ms", justify="right")
    st.add_column("share", justify="right")
    for name, v in stages.items():
        st.add_row(name, f"{v['mean_ms']:.1f}", f"{v['share']:.1%}")
    console.print(st)
    found = dominant(stages)
    if found is not None:
        group, share, why = found
        console.print(f"[bold]{group}[/bold] dominated ({share:.0%} of the time): {why}.")
