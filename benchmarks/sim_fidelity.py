"""Fidelity: the simulator with the calibrated CPU cost model beside `sendpath bench` on
the real server, request for request.

1. `sendpath serve --no-auth` on the built-in model with the engine defaults (64
   sequences, 512 batched tokens, 1 GiB of KV cache).
2. The cost model: `sendpath profile --url` against that server (its grid of loads:
   ``sendpath/sim/profile.py``); the workloads below are random mixes it never saw.
3. Per workload, capacity: the requests/s the server completes with all requests sent at
   once (a burst, so the batch fills).
4. Per load (25%, 55% and 85% of that capacity): `sendpath bench`'s client sends Poisson
   arrivals; the simulator replays the *same* requests (send times, prompt tokens as the
   server counted them, the prefix-cache hits, answer lengths, each first token's hold by
   the gateway's output filter), so only the model of the server differs; the profile
   gives a request's time outside the steps.
5. The machine's speed drifts on a shared host, so every run is also replayed at the
   speed it ran at: the profile's price of the steps the replica logged during the run
   (``GET /v1/steps``) over their measured time, one number per run.
6. Reported: p50 and p99 of TTFT, TPOT and E2E, simulated / measured, both ways; and per
   kind of step, the logged steps' measured time against the profile's price for them.
   Aim: p50 within 10% and p99 within 20% at the run's own speed.

    .venv/bin/python -m benchmarks.sim_fidelity [--requests N] [--workloads chat,long-prompt]
        [--loads 0.25,0.55,0.85]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx

from sendpath.bench.client import RequestResult
from sendpath.bench.command import served_model
from sendpath.bench.report import summarize
from sendpath.bench.runner import Load, run
from sendpath.bench.workload import LengthSpec, build
from sendpath.engine.steps import StepShape
from sendpath.fleet import free_port
from sendpath.sim.calibrated import Calibrated, step_kind, step_times
from sendpath.sim.profile import profile_served
from sendpath.sim.simulator import SimConfig, Simulator
from sendpath.sim.traffic import SimRequest

RESULTS = Path(__file__).parent / "results" / "sim_fidelity.json"
PROFILE = Path(__file__).parent / "results" / "sim_fidelity_profile.json"  # the served fit
STEPS = Path(__file__).parent / "results" / "sim_fidelity_steps.json"  # each run's step log
STEP_KEYS = ("seq", "start", "seconds", "busy_after", *(f.name for f in fields(StepShape)))
# (name, prompt words, answer tokens): random text, lengths drawn per request
WORKLOADS = (
    ("chat", LengthSpec(40, 200), LengthSpec(32, 128)),
    ("long-prompt", LengthSpec(300, 600), LengthSpec(16, 48)),
)
LOADS = (0.25, 0.55, 0.85)
METRICS = ("ttft", "tpot", "e2el")
REPLICA_KEY = secrets.token_urlsafe(16)  # the server's replicas want it for their step log


def bench(url: str, words: LengthSpec, out: LengthSpec, n: int, load: Load,
          seed: int) -> tuple[list[RequestResult], float]:  # fmt: skip
    conversations = build("random", n, words, out, seed=seed)
    model = asyncio.run(served_model(url, None))
    extra: dict[str, object] = {"ignore_eos": True, "temperature": 0.0}  # as `sendpath bench`
    return asyncio.run(run(url, model, conversations, load, extra=extra))


def replay(results: list[RequestResult], cost: Calibrated) -> dict[str, Any]:
    """The same requests through the simulator: same send times, lengths and holds on the
    first token (the gateway's ``first_token_held``) and the same shared start (the chat
    template's system prompt: the prompt tokens most requests had from the prefix cache).
    From the served profile ``cost``: step times, the engine's KV blocks and batch limits,
    and a request's time outside the steps."""
    ok = sorted((r for r in results if r.success), key=lambda r: r.start)
    t0 = ok[0].start
    rng = random.Random(0)
    hits = [r.cached_tokens or 0 for r in ok]
    shared = max(set(hits), key=hits.count)
    common = [rng.randrange(100, 30000) for _ in range(shared)]
    requests = []
    for i, r in enumerate(ok):
        n = r.prompt_tokens or 1
        start = common[: min(shared, n - 1)]
        rest = [rng.randrange(100, 30000) for _ in range(n - len(start))]
        requests.append(SimRequest(f"r{i}", r.start - t0, start + rest, r.output_tokens, i,
                                   held=r.first_token_held))  # fmt: skip
    return Simulator(cost.sim_config(SimConfig()), cost).run_requests(requests).report


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    out = {}
    for m in METRICS:
        out[f"p50_{m}"] = sim[f"median_{m}_ms"] / real[f"median_{m}_ms"]
        out[f"p99_{m}"] = sim[f"p99_{m}_ms"] / real[f"p99_{m}_ms"]
    return out


def logged_steps(url: str, after: int) -> list[dict[str, Any]]:
    """The replica's own step log since step ``after`` (``GET /v1/steps``)."""
    replica = httpx.get(f"{url}/fleet", timeout=30).json()["replicas"][0]["url"]
    key = {"Authorization": f"Bearer {REPLICA_KEY}"}
    found = httpx.get(f"{replica}/v1/steps", params={"after": after}, headers=key,
                      timeout=60).json()  # fmt: skip
    steps: list[dict[str, Any]] = found["steps"]
    return steps


def steps_vs_model(found: list[dict[str, Any]], cost: Calibrated) -> dict[str, dict[str, Any]]:
    """Per kind of step: how many, their measured seconds and the model's price for them."""
    out: dict[str, dict[str, Any]] = {}
    for shape, seconds in step_times(found):
        row = out.setdefault(step_kind(shape).value, {"steps": 0, "measured_s": 0.0,
                                                      "priced_s": 0.0})  # fmt: skip
        row["steps"] += 1
        row["measured_s"] += seconds
        row["priced_s"] += cost.step_seconds(shape)
    return out


def at_speed(cost: Calibrated, speed: float) -> Calibrated:
    """The profile on a machine running at ``speed`` of its profiled speed: every step
    price over ``speed``, which for a fit linear in its coefficients is each over it."""
    scaled = {term: c / speed for term, c in cost.coefficients.items()}
    return Calibrated(scaled, meta=cost.meta)


def within_target(runs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """How many ratios meet the aim (p50 within 10%, p99 within 20%), each way."""
    out = {}
    for model, key in (("served profile", "sim_over_real"),
                       ("at the run's speed", "at_run_speed_over_real")):  # fmt: skip
        p50 = [abs(r[key][f"p50_{m}"] - 1) <= 0.10 for r in runs for m in METRICS]
        p99 = [abs(r[key][f"p99_{m}"] - 1) <= 0.20 for r in runs for m in METRICS]
        out[model] = {"p50 within 10%": f"{sum(p50)} of {len(p50)}",
                      "p99 within 20%": f"{sum(p99)} of {len(p99)}"}  # fmt: skip
    return out


def print_table(runs: list[dict[str, Any]]) -> None:
    print("\n| workload | load | rate req/s | model | TTFT p50 / p99 | TPOT p50 / p99 | "
          "E2E p50 / p99 |")  # fmt: skip
    print("|---|---:|---:|---|---|---|---|")
    for r in runs:
        for model, x in (("served profile", r["sim_over_real"]),
                         (f"at the run's speed ({r['run_speed']:.2f})",
                          r["at_run_speed_over_real"])):  # fmt: skip
            cells = " | ".join(f"{x[f'p50_{m}']:.2f} / {x[f'p99_{m}']:.2f}" for m in METRICS)
            print(f"| {r['workload']} | {r['load']:.0%} | {r['rate']:.2f} | {model} | {cells} |")
    for model, counts in within_target(runs).items():
        print(f"{model}: " + ", ".join(f"{k}: {v}" for k, v in counts.items()))


def measure(url: str, cost: Calibrated, workloads: list[str], loads: list[float],
            n: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Every workload at every load, measured and replayed; the runs and their step logs."""
    runs: list[dict[str, Any]] = []
    step_log: dict[str, Any] = {"keys": [list(STEP_KEYS)]}
    for w, (name, words, out) in enumerate(WORKLOADS):
        if name not in workloads:
            continue
        burst, wall = bench(url, words, out, 32, Load(concurrency=64), seed=100 + w)
        capacity = sum(r.success for r in burst) / wall
        print(f"{name}: capacity {capacity:.2f} requests/s", flush=True)
        for i, share in enumerate(LOADS):
            if share not in loads:
                continue
            load = Load(rate=share * capacity, seed=i)
            found = logged_steps(url, 0)
            before = int(found[-1]["seq"]) if found else 0
            results, wall = bench(url, words, out, n, load, seed=10 * w + i)
            logged = logged_steps(url, before)
            step_log[f"{name} {share}"] = [[step[k] for k in STEP_KEYS] for step in logged]
            by_kind = steps_vs_model(logged, cost)
            speed = sum(k["priced_s"] for k in by_kind.values()) / sum(
                k["measured_s"] for k in by_kind.values())  # fmt: skip
            real = summarize(results, wall, percentiles=(50.0, 99.0))
            runs.append({
                "workload": name, "prompt_words": [words.low, words.high],
                "output_tokens": [out.low, out.high], "capacity_rps": capacity,
                "load": share, "rate": load.rate, "requests": n, "failed": real["failed"],
                "measured": real, "sim_over_real": compare(real, replay(results, cost)),
                "run_speed": round(speed, 3), "steps_vs_model": by_kind,
                "at_run_speed_over_real": compare(real, replay(results, at_speed(cost, speed))),
                "requests_measured": [
                    {"start": r.start, "prompt_tokens": r.prompt_tokens,
                     "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens,
                     "ttft": r.ttft, "latency": r.latency, "error": r.error,
                     "server_ms": r.timings, "first_token_held": r.first_token_held}
                    for r in results
                ],
            })  # fmt: skip
            for key in ("sim_over_real", "at_run_speed_over_real"):
                print(f"  {share:.0%} {key}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in runs[-1][key].items()), flush=True)  # fmt: skip
            print(f"    run speed {speed:.3f}; steps priced / measured: " + ", ".join(
                f"{kind} {row['priced_s'] / row['measured_s']:.2f} ({row['steps']})"
                for kind, row in by_kind.items()), flush=True)  # fmt: skip
    return runs, step_log


def wait_served(url: str, server: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    """Until the gateway at ``url`` has a healthy replica (``GET /health``; a gateway has
    no ``/ready``, which ``fleet.wait_healthy`` asks replicas)."""
    deadline = time.monotonic() + timeout_s
    while server.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("healthy"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"sendpath serve at {url} did not come up (exit code {server.poll()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="per load level")
    parser.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS))
    parser.add_argument("--loads", default=",".join(map(str, LOADS)), help="shares of capacity")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="sendpath-fidelity-"))
    port = free_port()
    env = {**os.environ, "SENDPATH_DATA_DIR": str(data), "SENDPATH_REPLICA_API_KEY": REPLICA_KEY}
    cmd = [sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port), "--no-auth"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_served(url, server)
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        started = time.perf_counter()
        cost = profile_served(url, replica_key=REPLICA_KEY)
        PROFILE.parent.mkdir(exist_ok=True)
        cost.save(PROFILE)
        print(f"served profile: {time.perf_counter() - started:.0f} s; fit {cost.error()}",
              flush=True)  # fmt: skip
        loads = [float(x) for x in args.loads.split(",")]
        runs, step_log = measure(url, cost, args.workloads.split(","), loads, args.requests)
    finally:
        server.terminate()
        server.wait(60)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    record = {"machine": machine, "profile": PROFILE.name, "profile_meta": cost.meta,
              "runs": runs, "within_target": within_target(runs)}  # fmt: skip
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    STEPS.write_text(json.dumps(step_log, separators=(",", ":")) + "\n")
    print_table(runs)


if __name__ == "__main__":
    main()
