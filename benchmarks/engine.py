"""The engine under load, in-process, beside transformers' generate on the same weights.

Workloads (random prompt tokens, ignore_eos, greedy): 128 in / 128 out at concurrency 1, 8
and 32, and 1024 in / 32 out at concurrency 4; and 128 / 128 at 32 sampled as chat clients
often ask (temperature 0.8, top_p 0.9; sendpath only). The engine runs what `sendpath serve` runs
(``--dtype auto --quantization auto``) unless told otherwise. sendpath runs its async engine with C
concurrent clients (a new request starts when one finishes); transformers runs one request
at a time (batch 1) and static batches of C. Reported: output tokens/s, requests/s, TTFT and
TPOT percentiles (TPOT = (e2e - ttft) / (output tokens - 1), as vllm bench serve defines it).

    .venv/bin/python benchmarks/engine.py [--only sendpath] [--workloads 128x128@32 ...]
        [--dtype float32 --quantization none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore
from sendpath.model.loader import builtin_model_path
from sendpath.request import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine.json"


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: int
    num_requests: int
    sampled: bool = False  # temperature 0.8 and top_p 0.9, else greedy

    @property
    def name(self) -> str:
        return f"{self.input_len}x{self.output_len}@{self.concurrency}" + " top-p" * self.sampled

    def params(self) -> SamplingParams:
        temperature, top_p = (0.8, 0.9) if self.sampled else (0.0, 1.0)
        return SamplingParams(
            max_tokens=self.output_len, temperature=temperature, top_p=top_p, ignore_eos=True
        )


DEFAULT = [
    Workload(128, 128, 1, 4),
    Workload(128, 128, 8, 16),
    Workload(128, 128, 32, 64),
    Workload(1024, 32, 4, 8),
    Workload(128, 128, 32, 64, sampled=True),
]


def prompts(w: Workload, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(w.input_len)] for _ in range(w.num_requests)]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(
    engine: str, w: Workload, wall: float, ttfts: list[float], e2es: list[float]
) -> dict[str, Any]:
    tpots = [(e - t) / (w.output_len - 1) for t, e in zip(ttfts, e2es, strict=True)]
    return {
        "engine": engine,
        "workload": w.name,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "concurrency": w.concurrency,
        "num_requests": w.num_requests,
        "duration_s": round(wall, 2),
        "request_throughput": round(w.num_requests / wall, 3),
        "output_throughput": round(w.num_requests * w.output_len / wall, 1),
        "mean_ttft_ms": round(1000 * statistics.mean(ttfts), 1),
        "median_ttft_ms": round(1000 * statistics.median(ttfts), 1),
        "p99_ttft_ms": round(1000 * pct(ttfts, 99), 1),
        "mean_tpot_ms": round(1000 * statistics.mean(tpots), 2),
        "median_tpot_ms": round(1000 * statistics.median(tpots), 2),
        "p99_tpot_ms": round(1000 * pct(tpots, 99), 2),
    }


async def run_sendpath(engine: AsyncEngine, w: Workload) -> dict[str, Any]:
    params = w.params()
    work = prompts(w)
    ttfts: list[float] = []
    e2es: list[float] = []
    sem = asyncio.Semaphore(w.concurrency)

    async def one(prompt: list[int]) -> None:
        async with sem:
            start = time.perf_counter()
            first = None
            n = 0
            async for out in engine.generate(prompt, params):
                n += len(out.new_token_ids)
                first = first or time.perf_counter()
            assert n == w.output_len and first is not None
            ttfts.append(first - start)
            e2es.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in work))
    return summarize("sendpath", w, time.perf_counter() - start, ttfts, e2es)


class _Stamps:
    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model: Any, w: Workload, batch: int) -> dict[str, Any]:
    """Static batches of ``batch`` requests (all prompts the same length: no padding)."""
    work = prompts(w)
    ttfts: list[float] = []
    e2es: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        group = torch.tensor(work[i : i + batch])
        stamps = _Stamps()
        t0 = time.perf_counter()
        model.generate(
            group,
            max_new_tokens=w.output_len,
            min_new_tokens=w.output_len,
            do_sample=False,
            pad_token_id=0,
            streamer=stamps if batch == 1 else None,
        )
        end = time.perf_counter()
        # batch 1: first token from the streamer (call 0 is the prompt); batches: unknown
        first = stamps.times[1] if batch == 1 else end
        ttfts += [first - t0] * len(group)
        e2es += [end - t0] * len(group)
    row = summarize(f"transformers (batch {batch})", w, time.perf_counter() - start, ttfts, e2es)
    if batch > 1:  # a static batch streams nothing: only throughput and e2e mean anything
        for key in [k for k in row if "ttft" in k or "tpot" in k]:
            row[key] = None
    return row


def bench_config(
    max_num_batched_tokens: int = 512,
    dtype: str = "auto",
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
) -> EngineConfig:
    """The engine every benchmark here runs: on the CPU, no prefix caching."""
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_memory_gib=2.0,
        enable_prefix_caching=False,
        cache_dtype=kv_cache_dtype,
    )
    return EngineConfig(
        dtype=dtype,
        quantization=quantization,
        device="cpu",
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens),
        cache=cache,
    )


def run_in_process(
    workloads: list[Workload],
    max_num_batched_tokens: int = 512,
    dtype: str = "auto",
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
) -> list[dict[str, Any]]:
    """Each workload through the async engine in this process, after a warm-up."""
    config = bench_config(max_num_batched_tokens, dtype, quantization, kv_cache_dtype, block_size)
    engine = AsyncEngine.build(lambda: EngineCore.from_config(config))  # on its own thread
    rows = []
    asyncio.run(run_sendpath(engine, Workload(16, 4, 2, 2)))  # warm-up
    for w in workloads:
        rows.append(asyncio.run(run_sendpath(engine, w)))
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["sendpath", "transformers"], default=None)
    parser.add_argument("--workloads", nargs="*", default=None, help="e.g. 128x128@32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto", help="auto: what `sendpath serve` runs")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or int8")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    workloads = DEFAULT
    if args.workloads:
        workloads = [w for w in DEFAULT if w.name in args.workloads]
    rows: list[dict[str, Any]] = []
    if args.only != "transformers":
        rows += run_in_process(
            workloads,
            args.max_num_batched_tokens,
            args.dtype,
            args.quantization,
            args.kv_cache_dtype,
            args.block_size,
        )
    if args.only != "sendpath":
        from transformers import AutoModelForCausalLM

        path = builtin_model_path()
        hf: Any = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        hf.eval()
        with torch.inference_mode():
            run_transformers(hf, Workload(16, 4, 1, 1), 1)  # warm-up
            shapes_done: set[tuple[int, int]] = set()
            for w in (w for w in workloads if not w.sampled):
                shape = (w.input_len, w.output_len)
                if shape not in shapes_done:  # batch 1 does not depend on the concurrency
                    shapes_done.add(shape)
                    one = Workload(w.input_len, w.output_len, 1, 4)
                    rows.append(run_transformers(hf, one, 1))
                    print(json.dumps(rows[-1]), flush=True)
                if w.concurrency > 1:
                    rows.append(run_transformers(hf, w, w.concurrency))
                    print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "engine",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1), CPU",
        "dtype": args.dtype,
        "quantization": args.quantization,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "sendpath_engine": {
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "prefix_caching": False,
        },
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
