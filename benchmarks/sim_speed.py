"""How fast the simulator runs: simulated requests per wall-clock second on one core, in
the detailed mode (the scheduler every step with every request) and the fleet mode
(decoding requests parked and advanced by a step counter), beside Vidur 0.0.26 on the
same workload in the same run.

The simulator runs compiled by mypyc (``sendpath/sim/compiled.py``, as `sendpath sim`
does); ``--python`` adds the same rows from a second process in Python, for the gain.

Workload: Llama-3.1-8B (roofline, H100), Poisson arrivals at about 70% of the fleet's
capacity, every prompt ``--prefill`` tokens and every answer ``--decode`` tokens (Vidur's
fixed-length generator takes the same), round-robin routing. Then the fleet mode at
scale: ``--scale-requests`` requests (default one million) over 128 replicas.

    .venv/bin/python -m benchmarks.sim_speed [--requests N] [--scale-requests N] [--python]
                                             [--repeat N]

Each row but the scale one is the fastest of ``--repeat`` runs (default 3), Vidur's too:
this shared host's speed drifts, and a 4,000-request run takes under a second.

Vidur runs from its own virtualenv (``.vidur-venv``, see benchmarks/README.md) through
``benchmarks/vidur_run.py``; without it that row is skipped, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sendpath.sim.compiled import use

HOW = use(lambda message: print(message, file=sys.stderr, flush=True))  # before the sim's imports

from sendpath.bench.workload import LengthSpec  # noqa: E402
from sendpath.sim.cost_model import Roofline  # noqa: E402
from sendpath.sim.hardware import hardware, model_spec  # noqa: E402
from sendpath.sim.simulator import SimConfig, Simulator  # noqa: E402
from sendpath.sim.traffic import Traffic  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sim_speed.json"
VIDUR = Path(__file__).parent.parent / ".vidur-venv" / "bin" / "python"
PER_REPLICA_RPS = 24.0  # ~70% of one H100's capacity at 512 in / 256 out (34 req/s, the sim)


def ours(mode: str, requests: int, replicas: int, prefill: int, decode: int) -> dict[str, Any]:
    traffic = Traffic(
        rate=PER_REPLICA_RPS * replicas,
        num_requests=requests,
        input_len=LengthSpec(prefill, prefill),
        output_len=LengthSpec(decode, decode),
    )
    cost = Roofline(model_spec("llama-3.1-8b"), hardware("H100"))
    start = time.perf_counter()
    sim = Simulator(SimConfig(replicas=replicas, mode=mode, num_blocks=28_000), cost)
    result = sim.run(traffic)
    wall = time.perf_counter() - start
    r = result.report
    name = f"sendpath {mode}" + ("" if HOW.startswith("compiled") else " (Python)")
    return {
        "simulator": name, "how": HOW, "requests": requests, "replicas": replicas,
        "wall_s": wall, "requests_per_s": requests / wall, "steps": result.num_steps,
        "utilization": sum(result.busy) / len(result.busy) / result.duration,
        "median_ttft_ms": r["median_ttft_ms"], "median_tpot_ms": r["median_tpot_ms"],
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }  # fmt: skip


def vidur(requests: int, replicas: int, prefill: int, decode: int) -> dict[str, Any] | None:
    if not VIDUR.exists():
        return None
    script = Path(__file__).parent / "vidur_run.py"
    cmd = [str(VIDUR), str(script), "--requests", str(requests), "--replicas", str(replicas),
           "--qps", str(PER_REPLICA_RPS * replicas), "--prefill-tokens", str(prefill),
           "--decode-tokens", str(decode), "--seed", "0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    found: dict[str, Any] = json.loads(line)
    found["replicas"] = replicas
    return found


def best(run: Callable[[], dict[str, Any] | None], repeat: int) -> dict[str, Any] | None:
    """The fastest of ``repeat`` runs (the same answers each time: this host's speed
    drifts from second to second), with every run's requests/s beside it."""
    found = [row for row in (run() for _ in range(repeat)) if row is not None]
    if not found:
        return None
    top = max(found, key=lambda row: row["requests_per_s"])
    return {**top, "each_requests_per_s": [row["requests_per_s"] for row in found]}


def python_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fleet rows from a second process that runs the simulator in Python."""
    cmd = [sys.executable, "-m", "benchmarks.sim_speed", "--rows-only",
           "--requests", str(args.requests), "--prefill", str(args.prefill),
           "--decode", str(args.decode), "--repeat", str(args.repeat)]  # fmt: skip
    env = dict(os.environ, SENDPATH_SIM_COMPILED="0")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--scale-requests", type=int, default=1_000_000)
    parser.add_argument("--scale-replicas", type=int, default=128)
    parser.add_argument("--python", action="store_true",
                        help="also the fleet rows in Python (a second process)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each row but the scale one; the fastest is kept")  # fmt: skip
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.rows_only:  # the --python process: its fleet rows, one JSON line each
        for replicas in (1, 16):
            shape = (args.requests, replicas, args.prefill, args.decode)
            row = best(partial(ours, "fleet", *shape), args.repeat)
            print(json.dumps(row))
        return
    rows: list[dict[str, Any]] = []
    for replicas in (1, 16):
        for mode in ("detailed", "fleet"):
            shape = (args.requests, replicas, args.prefill, args.decode)
            row = best(partial(ours, mode, *shape), args.repeat)
            assert row is not None
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        peer = best(partial(vidur, args.requests, replicas, args.prefill, args.decode),
                    args.repeat)  # fmt: skip
        if peer is not None:
            rows.append(peer)
            print(json.dumps(peer), flush=True)
    if args.python:
        rows += python_rows(args)
    if args.scale_requests:
        rows.append(ours("fleet", args.scale_requests, args.scale_replicas, args.prefill,
                         args.decode))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    from sendpath.model.quant import cpu_model  # after the runs: torch comes with it

    machine = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"
    record = {
        "machine": machine,
        "python": platform.python_version(),
        "simulator": HOW,
        "workload": {"prefill": args.prefill, "decode": args.decode},
        "runs": rows,
    }
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print("\n| simulator | replicas | requests | wall s | requests/s | vs Vidur |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        peer = next((p for p in rows if p["simulator"].startswith("vidur")
                     and p["replicas"] == row["replicas"]), None)  # fmt: skip
        ratio = f"{row['requests_per_s'] / peer['requests_per_s']:.1f}x" if peer else "-"
        print(f"| {row['simulator']} | {row['replicas']} | {row['requests']} | "
              f"{row['wall_s']:.1f} | {row['requests_per_s']:.0f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
