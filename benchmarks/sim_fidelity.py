"""Fidelity: the simulator with the calibrated CPU cost model beside `sendpath bench` on
the real server, request for request.

1. `sendpath serve --no-auth` on the built-in model with the engine defaults (64
   sequences, 512 batched tokens, 1 GiB of KV cache).
2. The cost model: `sendpath profile --url` against that server (its grid: single
   prompts of N tokens, B requests at once of C tokens each, fixed answer lengths); the
   workloads below are random mixes it never saw. ``--also FILE``: replay every run
   through a second cost model too (e.g. the in-process `sendpath profile`), side by side.
3. Per workload, capacity: the requests/s the server completes with all requests sent at
   once (a burst, so the batch fills).
4. Per load (25%, 55% and 85% of that capacity): `sendpath bench`'s client sends Poisson
   arrivals; the simulator replays the *same* requests (send times, prompt tokens as the
   server counted them, answer lengths; greedy, as `sendpath bench` sends them), so both
   sides see the same traffic and only the model of the server differs; each request's
   hold on its first token too (the gateway's ``first_token_held``). The replay takes
   from the profile a request's time outside the steps, and for requests without a
   recorded hold (runs saved before it was), the output filter's shares of holds.
5. The machine's speed drifts on a shared host (this one's steps took 15-45% longer some
   minutes than others). So each run's own step log is priced by the calibrated model in
   fifths of the run; where a fifth ran more than ``DRIFT`` off the calibrated speed, the
   run is taken again (``--retakes``, once by default) and the drift is recorded. A
   probe (``PROBE``: two of the profile grid's B x C loads, new prompts each time) runs
   just before and after each run; the profile's price of its steps over their time
   (``probe_speed``) is meant to measure the machine apart from the workload (the host
   has changed speed within a minute, too fast for that so far: benchmarks/README.md).
   Every run is replayed at that speed and at its steps' own too.
6. Reported: p50 and p99 of TTFT, TPOT and E2E, simulated / measured; and, step by
   step, the replica's own log of the run (``GET /v1/steps``) against what the cost model
   prices those very steps at, per kind of step (so a gap in the percentiles can be told
   apart: the price of a step, or the order of steps the simulator ran).

    .venv/bin/python -m benchmarks.sim_fidelity [--also FILE] [--requests N]
        [--workloads chat,long-prompt] [--loads 0.25,0.55,0.85]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sendpath.bench.client import RequestResult
from sendpath.bench.command import served_model
from sendpath.bench.report import summarize
from sendpath.bench.runner import Load, run
from sendpath.bench.workload import LengthSpec, build
from sendpath.config import SchedulerConfig
from sendpath.fleet import free_port, wait_healthy
from sendpath.sim.cost_model import Calibrated, CostModel, CpuStepShape
from sendpath.sim.profile_served import DEFAULT_SERVED, profile_served, step_kind, step_times
from sendpath.sim.served_loads import LoadDriver
from sendpath.sim.simulator import SimConfig, Simulator
from sendpath.sim.traffic import SimRequest

RESULTS = Path(__file__).parent / "results" / "sim_fidelity.json"
PROFILE = Path(__file__).parent / "results" / "sim_fidelity_profile.json"  # the served fit
STEPS = Path(__file__).parent / "results" / "sim_fidelity_steps.json"  # each run's step log
STEP_KEYS = ("seq", "start", "seconds", "busy_after", "num_tokens", "num_seqs",
             "context_tokens", "kv_tokens", "prompt_tokens", "prefills", "resumed",
             "kv_gathered")  # fmt: skip
# (name, prompt words, answer tokens): random text, lengths drawn per request
WORKLOADS = (
    ("chat", LengthSpec(40, 200), LengthSpec(32, 128)),
    ("long-prompt", LengthSpec(300, 600), LengthSpec(16, 48)),
)
LOADS = (0.25, 0.55, 0.85)
METRICS = ("ttft", "tpot", "e2el")
GAUGES = ("probe", "reference")  # the machine's speed around a run (meant as; see README)
ENGINE = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)  # the serve defaults
DRIFT = 0.10  # a run whose machine ran more than 10% off its calibrated speed is retaken
PROBE = ((16, 64), (8, 512))  # B x C: the loads that gauge the machine's speed around a run


def bench(url: str, words: LengthSpec, out: LengthSpec, n: int, load: Load,
          seed: int) -> tuple[list[RequestResult], float]:  # fmt: skip
    conversations = build("random", n, words, out, seed=seed)
    model = asyncio.run(served_model(url, None))
    extra: dict[str, object] = {"ignore_eos": True, "temperature": 0.0}  # as `sendpath bench`
    return asyncio.run(run(url, model, conversations, load, extra=extra))


def replay(results: list[RequestResult], cost: CostModel, profile: Calibrated) -> dict[str, Any]:
    """The same requests through the simulator: same send times, lengths and holds on the
    first token (the gateway's ``first_token_held``, where the run recorded it) and the
    same shared start (the chat template's system prompt: the prompt tokens most requests
    had from the prefix cache), so the simulated cache hits where the real one did. From
    the served ``profile``: the KV blocks, a request's time outside the engine's steps (on
    its round trip) and, for a request with no recorded hold, the output filter's shares."""
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
    num_blocks = profile.engine["num_blocks"]
    config = SimConfig(scheduler=ENGINE, num_blocks=num_blocks, **profile.outside_steps())
    sim = Simulator(config, cost).run_requests(requests)
    return sim.report


def measured(results: list[RequestResult], wall: float) -> dict[str, Any]:
    return summarize(results, wall, percentiles=(50.0, 99.0))


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    out = {}
    for m in METRICS:
        out[f"p50_{m}"] = sim[f"median_{m}_ms"] / real[f"median_{m}_ms"]
        out[f"p99_{m}"] = sim[f"p99_{m}_ms"] / real[f"p99_{m}_ms"]
    return out


def logged_steps(url: str, after: int) -> list[dict[str, Any]]:
    """The replica's own step log since step ``after`` (``GET /v1/steps``)."""
    replica = httpx.get(f"{url}/fleet", timeout=30).json()["replicas"][0]["url"]
    found = httpx.get(f"{replica}/v1/steps", params={"after": after}, timeout=60).json()
    steps: list[dict[str, Any]] = found["steps"]
    return steps


def steps_vs_model(
    found: list[dict[str, Any]], models: dict[str, Calibrated]
) -> dict[str, dict[str, Any]]:
    """Per kind of step: how many, their measured seconds and each model's price for the
    same shapes."""
    out: dict[str, dict[str, Any]] = {}
    for shape, seconds in step_times(found):
        row = out.setdefault(step_kind(shape).value, {"steps": 0, "measured_s": 0.0})
        row["steps"] += 1
        row["measured_s"] += seconds
        for name, model in models.items():
            row[f"{name}_s"] = row.get(f"{name}_s", 0.0) + model.step_seconds(shape)
    return out


def machine_speed(found: list[dict[str, Any]], cost: Calibrated) -> list[float]:
    """How fast the machine ran in each fifth of a run (by time), against its calibration:
    the model's price of the steps the replica logged over their measured time (1.0: as
    calibrated; 0.7: the same steps took 1/0.7 as long)."""
    timed = step_times(found)
    if not timed:
        return []
    starts = [step["start"] for step in found]
    t0, span = starts[0], max(starts[-1] - starts[0], 1e-9)
    priced, took = [0.0] * 5, [0.0] * 5
    for start, (shape, seconds) in zip(starts, timed, strict=True):
        k = min(4, int(5 * (start - t0) / span))
        priced[k] += cost.step_seconds(shape)
        took[k] += seconds
    return [round(p / t, 3) for p, t in zip(priced, took, strict=True) if t > 0]


def probe_speed(url: str, cost: Calibrated, seed: int) -> float:
    """The machine's speed now against its calibration: the profile's price of the steps
    of ``PROBE``'s loads, sent now (new prompts: ``seed``), over their measured time."""

    async def send() -> None:
        driver = LoadDriver(url, None)
        driver.rng = random.Random(seed)
        async with driver.client:
            model = await driver.model()
            for count, tokens in PROBE:  # sent as the grid's B x C loads are
                budget = cost.engine["max_num_batched_tokens"]
                await driver.load(model, count, tokens,
                                  DEFAULT_SERVED.batch_answer(count, tokens, budget))  # fmt: skip

    before = last_step(url)
    asyncio.run(send())
    timed = step_times(logged_steps(url, before))
    if not timed:
        raise RuntimeError(f"the probe's steps are not in {url}'s step log (GET /v1/steps)")
    return sum(cost.step_seconds(shape) for shape, _ in timed) / sum(s for _, s in timed)


def last_step(url: str) -> int:
    found = logged_steps(url, 0)
    return int(found[-1]["seq"]) if found else 0


class AtSpeed:
    """A cost model on a machine running at ``speed`` of its calibrated speed."""

    def __init__(self, base: CostModel, speed: float) -> None:
        self.base, self.speed = base, speed

    def step_seconds(self, shape: CpuStepShape) -> float:
        return self.base.step_seconds(shape) / self.speed


def at_run_speed(runs: list[dict[str, Any]], cost: Calibrated) -> None:
    """Each run replayed once more with the model scaled to the speed the machine ran at
    through it (one number per run: the model's price of the replica's logged steps over
    their measured time, from ``steps_vs_model``), beside the plain replay; kept in
    ``run_speed`` and ``at_run_speed_over_real``. And at the speed the probe found
    just before and after it (``probe_speed``, ``at_probe_speed_over_real``), meant to
    measure the machine apart from the workload; runs saved before the probe have the
    profile's reference request's (``reference_speed``). Neither has followed the host
    closely so far (benchmarks/README.md)."""
    for r in runs:
        kinds = r["steps_vs_model"].values()
        speed = sum(k["served_s"] for k in kinds) / sum(k["measured_s"] for k in kinds)
        results = [
            RequestResult(success=q["error"] is None, start=q["start"],
                          prompt_tokens=q["prompt_tokens"], cached_tokens=q.get("cached_tokens"),
                          output_tokens=q["output_tokens"], ttft=q["ttft"], latency=q["latency"],
                          error=q["error"], first_token_held=q.get("first_token_held"))
            for q in r["requests_measured"]
        ]  # fmt: skip
        r["run_speed"] = round(speed, 3)
        sim = replay(results, AtSpeed(cost, speed), cost)
        r["at_run_speed_over_real"] = compare(r["measured"], sim)
        for gauge in GAUGES:
            if r.get(f"{gauge}_speed"):
                sim = replay(results, AtSpeed(cost, r[f"{gauge}_speed"]), cost)
                r[f"at_{gauge}_speed_over_real"] = compare(r["measured"], sim)


def within_target(runs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """How many ratios meet the targets (p50 within 10%, p99 within 20%), per model."""
    out = {}
    for model, key in (("served profile", "sim_over_real"),
                       ("served, at the run's speed", "at_run_speed_over_real"),
                       *((f"served, at the {g}'s speed", f"at_{g}_speed_over_real")
                         for g in GAUGES)):  # fmt: skip
        rows = [r[key] for r in runs if r.get(key)]
        if not rows:
            continue
        p50 = [abs(x[f"p50_{m}"] - 1) <= 0.10 for x in rows for m in METRICS]
        p99 = [abs(x[f"p99_{m}"] - 1) <= 0.20 for x in rows for m in METRICS]
        out[model] = {"p50 within 10%": f"{sum(p50)} of {len(p50)}",
                      "p99 within 20%": f"{sum(p99)} of {len(p99)}"}  # fmt: skip
    return out


def print_table(runs: list[dict[str, Any]]) -> None:
    print("\n| workload | load | rate req/s | model | TTFT p50 / p99 | TPOT p50 / p99 | "
          "E2E p50 / p99 |")  # fmt: skip
    print("|---|---:|---:|---|---|---|---|")
    for r in runs:
        rows = (("served profile", r["sim_over_real"]),
                ("in-process profile", r["also_over_real"]),
                (f"served, at the run's speed ({r.get('run_speed', 0):.2f})",
                 r.get("at_run_speed_over_real")),
                *((f"served, at the {g}'s speed ({r.get(f'{g}_speed', 0):.2f})",
                   r.get(f"at_{g}_speed_over_real")) for g in GAUGES))  # fmt: skip
        for model, x in rows:
            if x is None:
                continue
            cells = " | ".join(f"{x[f'p50_{m}']:.2f} / {x[f'p99_{m}']:.2f}" for m in METRICS)
            print(f"| {r['workload']} | {r['load']:.0%} | {r['rate']:.2f} | {model} | {cells} |")
    for model, counts in within_target(runs).items():
        print(f"{model}: " + ", ".join(f"{k}: {v}" for k, v in counts.items()))


def rescore() -> None:
    """Recompute the run-speed replays from the saved results (no server)."""
    record = json.loads(RESULTS.read_text())
    at_run_speed(record["runs"], Calibrated.load(PROFILE))
    record["within_target"] = within_target(record["runs"])
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print_table(record["runs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--also", type=Path, default=None, metavar="FILE",
                        help="a second cost model to replay every run through")  # fmt: skip
    parser.add_argument("--requests", type=int, default=48, help="per load level")
    parser.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS))
    parser.add_argument(
        "--retakes", type=int, default=1, help="times a run is taken again when the machine drifts"
    )
    parser.add_argument("--loads", default=",".join(map(str, LOADS)), help="shares of capacity")
    parser.add_argument("--rescore", action="store_true",
                        help="only redo the run-speed replays of the saved results")  # fmt: skip
    args = parser.parse_args()
    if args.rescore:
        return rescore()
    workloads = [w for w in WORKLOADS if w[0] in args.workloads.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    also = Calibrated.load(args.also) if args.also else None
    data = Path(tempfile.mkdtemp(prefix="sendpath-fidelity-"))
    port = free_port()
    env = {**os.environ, "SENDPATH_DATA_DIR": str(data)}
    cmd = [sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port), "--no-auth"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    runs: list[dict[str, Any]] = []
    try:
        wait_healthy({url: server}, 300)
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        cost = profile_served(url)
        PROFILE.parent.mkdir(exist_ok=True)
        cost.save(PROFILE)
        print(f"served profile: {cost.meta['wall_s']:.0f} s; fit {cost.error()}; "
              f"held out {cost.error(True)}; first tokens held by the output filter "
              f"{cost.meta['first_token_hold']}", flush=True)  # fmt: skip
        step_log: dict[str, list[list[Any]]] = {"keys": [list(STEP_KEYS)]}
        models = {"served": cost, **({"also": also} if also else {})}
        for w, (name, words, out) in enumerate(WORKLOADS):
            if (name, words, out) not in workloads:
                continue
            burst, wall = bench(url, words, out, 32, Load(concurrency=64), seed=100 + w)
            capacity = sum(r.success for r in burst) / wall
            print(f"{name}: capacity {capacity:.2f} requests/s", flush=True)
            for i, share in enumerate(LOADS):
                if share not in loads:
                    continue
                load = Load(rate=share * capacity, seed=i)
                retaken: list[list[float]] = []
                while True:
                    start = time.perf_counter()
                    probes = [probe_speed(url, cost, 7000 + 2 * len(runs) + 100 * len(retaken))]
                    before = last_step(url)
                    # a retake sends new prompts: the old ones would hit the prefix cache
                    seed = 10 * w + i + 1000 * len(retaken)
                    results, wall = bench(url, words, out, args.requests, load, seed=seed)
                    logged = logged_steps(url, before)
                    probes.append(probe_speed(url, cost, 7001 + 2 * len(runs) + 100 * len(retaken)))
                    speed = machine_speed(logged, cost)
                    if all(abs(x - 1) <= DRIFT for x in speed) or len(retaken) >= args.retakes:
                        break
                    print(f"  {share:.0%}: the machine ran at {speed} of its calibrated speed "
                          "(by fifths of the run): taken again", flush=True)  # fmt: skip
                    retaken.append(speed)
                by_kind = steps_vs_model(logged, models)
                step_log[f"{name} {share}"] = [[step[k] for k in STEP_KEYS] for step in logged]
                real = measured(results, wall)
                sim = replay(results, cost, cost)
                ratios = compare(real, sim)
                other = compare(real, replay(results, also, cost)) if also else None
                runs.append({
                    "workload": name, "prompt_words": [words.low, words.high],
                    "output_tokens": [out.low, out.high], "capacity_rps": capacity,
                    "load": share, "rate": load.rate, "requests": args.requests,
                    "failed": real["failed"], "wall_s": time.perf_counter() - start,
                    "measured": real, "simulated": sim, "sim_over_real": ratios,
                    "also_over_real": other, "steps_vs_model": by_kind,
                    "machine_speed_by_fifth": speed, "retaken": retaken,
                    # the machine's speed by the probe just before and after this run
                    "probe_speeds": [round(x, 3) for x in probes],
                    "probe_speed": round(statistics.fmean(probes), 3),
                    "requests_measured": [
                        {"start": r.start, "prompt_tokens": r.prompt_tokens,
                         "cached_tokens": r.cached_tokens,
                         "output_tokens": r.output_tokens, "ttft": r.ttft, "latency": r.latency,
                         "error": r.error, "server_ms": r.timings,
                         "first_token_held": r.first_token_held}
                        for r in results
                    ],
                })  # fmt: skip
                print(f"  {share:.0%}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()),
                      flush=True)  # fmt: skip
                print(f"    machine speed by the probe before and after: "
                      f"{runs[-1]['probe_speeds']}", flush=True)  # fmt: skip
                print("    steps priced / measured: " + ", ".join(
                    f"{kind} {row['served_s'] / row['measured_s']:.2f} ({row['steps']})"
                    for kind, row in by_kind.items()), flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    record = {"machine": machine, "profile": PROFILE.name, "profile_meta": cost.meta,
              "also": str(args.also) if args.also else None,
              "also_meta": also.meta if also else None, "runs": runs}  # fmt: skip
    at_run_speed(runs, cost)
    record["within_target"] = within_target(runs)
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    STEPS.write_text(json.dumps(step_log, separators=(",", ":")) + "\n")
    print_table(runs)


if __name__ == "__main__":
    main()
