"""The engine benchmark's workloads over HTTP against `sendpath replica`, beside in-process.

Starts `sendpath replica` (the settings of benchmarks/engine.py's `bench_config`), drives it
with streaming `/v1/completions` requests (prompt token ids, ignore_eos, greedy or sampled
as the workload says) from C concurrent httpx clients, as the peers' figures in the engine
issue were measured, and runs the in-process engine on the same workloads in the same run:
the ratio is the cost of the HTTP layer (uvicorn, JSON, SSE, the client on the same cores).

    .venv/bin/python -m benchmarks.over_http [--workloads 128x128@32 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.engine import DEFAULT, Workload, prompts, run_in_process, summarize

RESULTS = Path(__file__).parent / "results" / "over_http.json"
BATCHED_TOKENS = 512


async def run_http(url: str, w: Workload) -> dict[str, Any]:
    ttfts: list[float] = []
    e2es: list[float] = []
    sem = asyncio.Semaphore(w.concurrency)
    limits = httpx.Limits(max_connections=w.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        params = w.params()

        async def one(prompt: list[int]) -> None:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": prompt,
                "max_tokens": w.output_len,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with sem:
                start = time.perf_counter()
                first = None
                generated = 0
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                            first = first or time.perf_counter()
                        if chunk.get("usage"):
                            generated = chunk["usage"]["completion_tokens"]
                assert first is not None and generated == w.output_len
                ttfts.append(first - start)
                e2es.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts(w)))
        return summarize("sendpath replica (HTTP)", w, time.perf_counter() - start, ttfts, e2es)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="*", default=None, help="e.g. 128x128@32")
    args = parser.parse_args()
    workloads = [w for w in DEFAULT if not args.workloads or w.name in args.workloads]
    rows: list[dict[str, Any]] = []

    rows += run_in_process(workloads, BATCHED_TOKENS)

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sendpath.cli",
        "replica",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-num-batched-tokens",
        str(BATCHED_TOKENS),
        "--kv-cache-memory-gib",
        "2.0",
        "--no-prefix-caching",
    ]
    proc = subprocess.Popen(cmd, env={**os.environ}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready").status_code == 200:  # the model loaded
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        asyncio.run(run_http(url, Workload(16, 4, 2, 2)))  # warm-up
        for w in workloads:
            rows.append(asyncio.run(run_http(url, w)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    ratios = {}
    for w in workloads:
        local, http = (r for r in rows if r["workload"] == w.name)
        ratios[w.name] = round(http["output_throughput"] / local["output_throughput"], 3)
    result = {
        "benchmark": "http",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1), --dtype auto --quantization auto, CPU",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "http_over_in_process_output_throughput": ratios,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(ratios))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
