"""Where a decode step's time goes, by kind of work, at a few batch sizes, and a long
prompt's prefill step.

The built-in model in the configuration ``make serve`` runs (``--dtype auto
--quantization auto``), B requests decoding with ~190-token contexts (random prompt
tokens), profiled over 10 steps with torch's profiler. Each aten op's own CPU time is put
in one bucket: low-precision matmuls (sendpath's block kernel on AVX-512 VNNI, else
torch's int4 / int8 weight kernels), dense matmuls, attention (the paged attention kernel or
torch's SDPA), and the rest (norms, RoPE, sampling, the cache writes, and the Python and
dispatch between them: the step's wall time less the three buckets). Where the model
runs every layer in one C++ call (``model/layer_stack.py``), the profiler cannot see the
kernels inside it: the step is timed that way first, then profiled with the layers'
modules calling the same kernels one by one. A prefill row is one step of a fresh
``--prefill N``-token prompt (a single chunk), profiled the same way over 3 prompts.
Then issue 38's offline aims, beside the machine's roofs measured in the same run
(``peers.py``'s): the share of the best matmul FLOP/s that 32 decodes and four 1,000-token
prompts arriving at once (timed to the last one's first token) turn into tokens, at 2 x
parameters a token.
Compare with ``--dtype float32 --quantization none``, or an int8 KV cache with
``--kv-cache-dtype int8``.

    .venv/bin/python -m benchmarks.step_profile [--batches 1 8 32] [--prefill 1024]  # a minute
    .venv/bin/python -m benchmarks.step_profile --dtype float32 --quantization none \
        --output benchmarks/results/step_profile_float32.json

Results: ``benchmarks/results/step_profile.json`` (the float32 and int8-cache ones beside it).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.peers import PARAMETERS, roofs
from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.engine.core import EngineCore
from sendpath.model.kernels import cpu_kernels
from sendpath.model.quant import BlockWeights, cpu_model, matrix_engine
from sendpath.request import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "step_profile.json"
STEPS = 10
BUCKETS = {
    "low-precision matmul": ("_weight_int4pack_mm", "_weight_int8pack_mm", "block_matmul"),
    "dense matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "_linear_pointwise"),
    "attention": ("paged_attention", "scaled_dot_product", "_flash_attention"),
}


def bucket(name: str) -> str | None:
    for label, keys in BUCKETS.items():
        if any(k in name for k in keys):
            return label
    return None


def decoding(core: EngineCore, batch: int) -> None:
    """Start ``batch`` requests and step until every one of them decodes."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for _ in range(batch):
        core.add_request([rng.randrange(100, 40_000) for _ in range(180)], params)
    while core.stats().num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(8):  # a few decode steps first: warm caches, ~190-token contexts
        core.step()


class _Named:
    """The CPU kernels' module with the paged attention call named for the profiler (a
    pybind function is invisible to it otherwise)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:  # the module's other kernels, as they are
        return getattr(self.module, name)

    def paged_attention(self, *args: Any) -> torch.Tensor:
        with record_function("paged_attention"):
            out: torch.Tensor = self.module.paged_attention(*args)
        return out


def _named_block_matmul() -> None:
    """``BlockWeights.matmul`` named for the profiler (its kernel is a pybind function)."""
    plain = BlockWeights.matmul

    def matmul(self: BlockWeights, x: torch.Tensor, loop: str = "") -> torch.Tensor:
        with record_function("block_matmul"):
            return plain(self, x, loop)

    BlockWeights.matmul = matmul  # type: ignore[method-assign]


def profile_batch(core: EngineCore, batch: int) -> dict[str, Any]:
    decoding(core, batch)
    row = {"batch": batch} | profile_steps(core, lambda: None, STEPS)
    for request in list(core.scheduler.running):
        core.abort(request.request_id)
    return row


def profile_prefill(core: EngineCore, tokens: int) -> dict[str, Any]:
    """One step of a fresh ``tokens``-token prompt, over 3 prompts (after one unprofiled)."""
    rng = random.Random(tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def arrive() -> None:
        while core.has_unfinished_requests():  # the last prompt's request, finished
            core.step()
        core.add_request([rng.randrange(100, 40_000) for _ in range(tokens)], params)

    arrive()
    core.step()
    return {"prefill_tokens": tokens} | profile_steps(core, arrive, 3)


def prompts_at_once(core: EngineCore, prompts: int, tokens: int) -> dict[str, Any]:
    """``prompts`` fresh ``tokens``-token prompts added at once, timed (as served) from
    their arrival to the step that gives the last of them its first token."""
    rng = random.Random(prompts * tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(prompts):
        core.add_request([rng.randrange(100, 40_000) for _ in range(tokens)], params)
    start = time.perf_counter()
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"prompts": prompts, "tokens": tokens, "steps": steps, "ms": round(seconds * 1e3, 1)}


def aims(
    rows: list[dict[str, Any]], batch: dict[str, Any], roof: dict[str, float]
) -> dict[str, Any]:
    """Issue 38's offline aims: the share of the best matmul FLOP/s measured in this run that
    32 decodes and a batch of ~1,000-token prompts turn into tokens (2 x parameters a token)."""
    best = max(v for k, v in roof.items() if "matmul" in k) * 1e9
    out: dict[str, Any] = {"best_matmul_gflop_per_s": round(best / 1e9, 1)}
    for row in rows:
        if row.get("batch") == 32:
            seconds = (row["step_ms (layers in one call)"] or row["step_ms"]) / 1e3
            out["32_decodes_share"] = round(2 * PARAMETERS * 32 / seconds / best, 3)
    tokens = batch["prompts"] * batch["tokens"]
    out[f"{batch['prompts']}_prompts_share"] = round(
        2 * PARAMETERS * tokens / (batch["ms"] / 1e3) / best, 3
    )
    return out


def profile_steps(core: EngineCore, before: Callable[[], None], steps: int) -> dict[str, Any]:
    """``steps`` steps (each after ``before()``) timed as served, then profiled by bucket."""
    model = core.runner.model  # type: ignore[attr-defined]
    stack, in_one_call = model.stack, None
    if stack is not None:  # the step as served, then its modules' kernels one by one
        total = 0.0
        for _ in range(steps):
            before()
            start = time.perf_counter()
            core.step()
            total += time.perf_counter() - start
        in_one_call = round(total * 1e3 / steps, 2)
        model.stack = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total = 0.0
        for _ in range(steps):
            before()  # outside the timed span; the profiler sees it, but in no bucket
            start = time.perf_counter()
            core.step()
            total += time.perf_counter() - start
        wall_ms = total * 1e3 / steps
    spent = dict.fromkeys(BUCKETS, 0.0)
    for event in prof.key_averages():
        label = bucket(event.key)
        if label is not None:
            spent[label] += event.self_cpu_time_total / 1e3 / steps
    model.stack = stack
    row: dict[str, Any] = {"step_ms (layers in one call)": in_one_call}
    row["step_ms"] = round(wall_ms, 2)
    row |= {k: round(v, 2) for k, v in spent.items()}
    row["the rest"] = round(wall_ms - sum(spent.values()), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[1024], help="prompt lengths")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or int8")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = EngineConfig(
        dtype=args.dtype,
        quantization=args.quantization,
        device="cpu",
        scheduler=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=max([512, *args.prefill])
        ),
        cache=CacheConfig(
            kv_cache_memory_gib=1.0, enable_prefix_caching=False, cache_dtype=args.kv_cache_dtype
        ),
    )
    core = EngineCore.from_config(config)
    _named_block_matmul()
    attention = core.runner.attention  # type: ignore[attr-defined]
    if attention.kernel is not None:
        attention.kernel = _Named(attention.kernel)
    rows = [profile_batch(core, b) for b in args.batches]
    rows += [profile_prefill(core, n) for n in args.prefill]
    batch = prompts_at_once(core, 4, 1000)
    roof = roofs()  # the same run: the machine's matmul and copy roofs
    print(
        "| step | step ms, layers in one call | step ms | " + " | ".join(BUCKETS) + " | the rest |"
    )
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    shares = aims(rows, batch, roof)
    print("four 1,000-token prompts:", json.dumps(batch), "| roofs:", json.dumps(roof))
    print("shares of the best matmul FLOP/s:", json.dumps(shares))
    result = {
        "cpu": cpu_model(),
        "matrix_engine": matrix_engine(cpu_kernels()),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "prompts_at_once": batch,
        "roofs": roof,
        "shares": shares,
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
