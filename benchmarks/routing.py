"""Routing policies side by side: 2 replicas, a multi-turn chat with a shared system prompt.

For each policy (`prefix_aware`, `round_robin`, `least_load`) in one run: two fresh
`sendpath replica` processes on the built-in model (empty caches), `sendpath gateway
--policy P` in front, and the same workload: N conversations at once, each T turns in
sequence (the next turn sends the whole history: system prompt, every question and every
answer), greedy so the answers are the same under every policy. Reported per policy: the
prefix-cache hit rate (cached / prompt tokens, from `usage`), TTFT p50/p99 measured by the
client (time to the first text chunk), the whole run's wall time, and how conversations
spread over the replicas.

With ``--gateways 2`` each conversation alternates between two gateways in front of the
same replicas (turn t of conversation c goes to gateway (c + t) % 2), the replicas publish
KV events, and ``--prefix-routing approximate precise`` runs prefix_aware both ways: each
gateway guessing from what it sent, or both following the replicas' events.

    .venv/bin/python -m benchmarks.routing [--conversations 32 --turns 4 --max-tokens 16]
        [--arrival-rate R --think S] [--out benchmarks/results/routing.json]
    .venv/bin/python -m benchmarks.routing --gateways 2 --policies prefix_aware \
        --prefix-routing approximate precise --out benchmarks/results/routing_gateways.json
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
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from sendpath.config import KVEventsConfig
from sendpath.fleet import LocalFleet, free_port
from sendpath.model.quant import cpu_model

RESULTS = Path(__file__).parent / "results" / "routing.json"
EVENTS = KVEventsConfig(  # each replica's own ports, picked by the OS
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
)
POLICIES = ("prefix_aware", "round_robin", "least_load")
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are the support assistant of a small bicycle shop in Utrecht. You answer in two "
    "short sentences, in plain English, without lists. You know the shop opens at nine and "
    "closes at six, repairs take two days, a new inner tube costs eight euros, and rental "
    "bikes must be back by closing time. If you do not know something, say so and suggest "
    "calling the shop. Never invent prices that were not given to you here."
)
QUESTIONS = [
    "My back tyre is flat, what should I do?",
    "How long will a repair take?",
    "Can I rent a bike while mine is being fixed?",
    "What time do I have to bring the rental back?",
    "Do you sell helmets?",
    "Is it cheaper to replace the tube myself?",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def conversation(
    clients: list[httpx.AsyncClient],
    c: int,
    args: argparse.Namespace,
    out: list[dict[str, Any]],
) -> None:
    rng = random.Random(c)
    turns, max_tokens = args.turns, args.max_tokens
    if args.arrival_rate:  # conversations start as a Poisson process
        await asyncio.sleep(sum(rng.expovariate(args.arrival_rate) for _ in range(c + 1)))
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        if t and args.think:  # the user reads the answer and types the next question
            await asyncio.sleep(rng.expovariate(1 / args.think))
        question = f"(customer {c}) " + QUESTIONS[(c + t) % len(QUESTIONS)]
        messages.append({"role": "user", "content": question})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft, text, usage, timings = None, "", {}, {}
        client = clients[(c + t) % len(clients)]
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            replica = r.headers["x-sendpath-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("timings"):
                    timings = event["timings"]
                for choice in event.get("choices", []):
                    delta = choice["delta"].get("content")
                    if delta:
                        ttft = ttft or time.perf_counter() - start
                        text += delta
        messages.append({"role": "assistant", "content": text})
        out.append(
            {
                "conversation": c,
                "turn": t,
                "replica": replica,
                "ttft_s": ttft,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "timings": timings,
            }
        )


async def workload(urls: list[str], args: argparse.Namespace) -> list[Any]:
    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.conversations + 4)
    clients = [httpx.AsyncClient(base_url=u, timeout=900, limits=limits) for u in urls]
    try:
        await asyncio.gather(
            *(conversation(clients, c, args, out) for c in range(args.conversations))
        )
    finally:
        for client in clients:
            await client.aclose()
    return out


def gateway_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Wait until the gateway's /health is 200 (its replicas checked and healthy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway at {url} exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} was not healthy after {timeout_s:g} s")
        time.sleep(0.2)


def run_policy(policy: str, routing: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    events = EVENTS if args.gateways > 1 else None
    with LocalFleet(2, ["--max-num-seqs", str(args.conversations)], kv_events=events) as fleet:
        fleet.wait_healthy(300)
        gateways: dict[str, subprocess.Popen[bytes]] = {}
        for _ in range(args.gateways):
            port = free_port()
            gateways[f"http://127.0.0.1:{port}"] = subprocess.Popen(
                [
                    sys.executable, "-m", "sendpath.cli", "gateway", "--port", str(port),
                    "--no-auth", "--policy", policy, "--prefix-routing", routing,
                    "--data-dir", str(tmp),
                    *(arg for u in fleet.urls for arg in ("--replica", u)),
                ],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
        try:
            for url, gateway in gateways.items():
                gateway_up(url, gateway)
            time.sleep(2.0)  # two health rounds: the gateways find the replicas' events
            start = time.perf_counter()
            turns = asyncio.run(workload(list(gateways), args))
            wall = time.perf_counter() - start
        finally:
            for gateway in gateways.values():
                gateway.terminate()
                gateway.wait(30)
    ttfts = [t["ttft_s"] * 1000 for t in turns if t["ttft_s"] is not None]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    homes = Counter(
        len({t["replica"] for t in turns if t["conversation"] == c})
        for c in range(args.conversations)
    )
    spread = Counter(t["replica"] for t in turns if t["turn"] == 0)
    stages = ("gateway.queue", "engine.queue", "prefill", "decode")
    stage_ms = {
        s: round(statistics.fmean(t["timings"].get(s, 0.0) for t in turns), 1) for s in stages
    }
    return {
        "policy": policy,
        "prefix_routing": routing if policy == "prefix_aware" else None,
        "gateways": args.gateways,
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4),
        "ttft_ms_p50": round(statistics.median(ttfts), 1),
        "ttft_ms_p99": round(percentile(ttfts, 0.99), 1),
        "wall_s": round(wall, 1),
        "conversations_on_one_replica": homes[1],
        "first_turns_per_replica": sorted(spread.values()),
        "mean_stage_ms": stage_ms,  # the server's view of where each request's time went
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument(
        "--gateways", type=int, default=1, help="gateways the turns alternate between (1)"
    )
    parser.add_argument(
        "--prefix-routing",
        nargs="+",
        default=["precise"],
        choices=["precise", "approximate"],
        help="prefix_aware's modes to run (replicas publish KV events when --gateways > 1)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        help="conversations start at this Poisson rate per second (default: all at once)",
    )
    parser.add_argument(
        "--think", type=float, default=0.0, help="mean seconds a user waits between turns"
    )
    args = parser.parse_args()
    tmp = Path("/tmp") / f"sendpath-routing-{int(time.time())}"
    results = []
    runs = [
        (policy, routing)
        for policy in args.policies
        for routing in (args.prefix_routing if policy == "prefix_aware" else ["precise"])
    ]
    for policy, routing in runs:
        print(f"{policy} ({routing}): running...", flush=True)
        results.append(run_policy(policy, routing, args, tmp))
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(exist_ok=True)
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}",
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "arrival_rate": args.arrival_rate,
            "think_s": args.think,
            "replicas": 2,
            "gateways": args.gateways,
            "model": MODEL,
        },
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n| policy | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | wall s |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        name = r["policy"] + (f" ({r['prefix_routing']})" if r["prefix_routing"] else "")
        print(
            f"| {name} | {r['hit_rate']:.1%} | {r['ttft_ms_p50']} | {r['ttft_ms_p99']} "
            f"| {r['wall_s']} |"
        )


if __name__ == "__main__":
    main()
