"""sendpath's own engine step on a GPU, for the simulator's GPU cost model (issue 43).

A randomly initialised Llama-3.1-8B-shaped model (bfloat16; timing does not depend on the
weights' values, as vLLM's ``--load-format dummy`` assumes) is served by the engine
`sendpath replica` runs (``EngineCore``: scheduler, paged KV cache, chunked prefill), in
this process, with token-id prompts (no tokenizer work). It runs a grid of loads and keeps
every step the engine logged, its shape and wall time:

- single prompts of P tokens (prefill: FLOPs over an achieved FLOP/s), and one after a
  cached prefix (the chunk attends to context it did not compute);
- B requests of C tokens decoding together (decode: weights + KV bytes over an achieved
  bandwidth), for a grid of batch sizes and contexts that fit the KV cache;
- B short requests decoding while prompts of each ``late`` size come one at a time (mixed
  steps, as a chat server runs).

The machine's roofs are measured in the same run: a large bfloat16 matmul's FLOP/s and a
device-to-device copy's bytes/s. Each decode and prefill point is reported beside them as
the share of the roof it reached. The steps are fitted with the CPU's calibrated form
(``sendpath/sim/calibrated.py``) and that fit is written as a ``sendpath-profile`` file
(``--profile-out``) that ``sendpath sim --cost-model`` reads. The raw steps stay in the
results (``--out``) for richer GPU fits.

The engine runs torch's ops on a GPU (``runner/paged_attention.py``: SDPA per prompt
chunk, gathered blocks for decodes), eagerly, without CUDA graphs: these are sendpath's
figures, not vLLM's.

    python benchmarks/gpu_step.py                        # on the GPU (about 3 minutes)
    python benchmarks/gpu_step.py --tiny --device cpu    # a tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.engine.core import EngineCore
from sendpath.model.llama import LlamaConfig
from sendpath.model.loader import random_model
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import SamplingParams
from sendpath.sim.calibrated import Calibrated, PointKind, ProfilePoint, points, step_times

RESULTS = Path(__file__).parent / "results" / "gpu_step.json"
PROFILE = Path(__file__).parent / "results" / "gpu_step_profile.json"

# Llama-3.1-8B's shape (its config.json); RoPE scaling left out: it changes no cost
LLAMA_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)
TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Grid:
    prefill: tuple[int, ...]  # single prompts of P tokens
    cached: tuple[int, int]  # a prompt of (prefix + new) tokens after its prefix was cached
    batches: tuple[int, ...]  # B requests decoding together
    contexts: tuple[int, ...]  # of C prompt tokens each
    answer: int  # decode steps with all B running
    riders: tuple[int, ...]  # B short requests decoding while ``late`` prompts come
    late: tuple[int, ...]


GPU_GRID = Grid(
    prefill=(128, 512, 1024, 2048, 4096, 8192),
    cached=(4096, 1024),
    batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    contexts=(128, 1024, 4096),
    answer=16,
    riders=(16, 64, 128),
    late=(512, 2048),
)
TINY_GRID = Grid(
    prefill=(16, 64),
    cached=(64, 16),
    batches=(1, 4),
    contexts=(16, 64),
    answer=4,
    riders=(4,),
    late=(32,),
)


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer of ``vocab_size`` words ``t0``, ``t1``...: the engine decodes each
    request's text as it goes, and these prompts are token ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, None, None, None, [vocab_size - 1])


def roofs(device: torch.device, size: int) -> dict[str, float]:
    """The machine's bfloat16 matmul FLOP/s (``size`` cubed) and device copy bytes/s (a
    copy reads and writes: both counted), each the best of ten after three warm-ups."""

    def best(run: Any) -> float:
        for _ in range(3):
            run()
        times = []
        for _ in range(10):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    matmul_s = best(lambda: a @ b)
    src = torch.empty(size * size * 16, dtype=torch.bfloat16, device=device)  # 32 * size^2 B
    dst = torch.empty_like(src)
    copy_s = best(lambda: dst.copy_(src))
    return {
        "matmul_bf16_flops": 2 * size**3 / matmul_s,
        "matmul_size": size,
        "copy_bytes_per_s": 2 * src.numel() * src.element_size() / copy_s,
        "copy_bytes": src.numel() * src.element_size(),
    }


def first_calls(device: torch.device, tiny: bool) -> dict[str, Any]:
    """What a step pays for a shape it has not run before, op by op: each case's first call
    on each new shape against a repeat (ms), per SDPA backend. A serving engine meets new
    shapes all the time (batch sizes, contexts crossing a block)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def timed(run: Any) -> float:
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        return (time.perf_counter() - start) * 1e3

    def case(make: Any, sizes: tuple[int, ...]) -> dict[str, Any]:
        firsts, repeats = [], []
        try:
            for n in sizes:
                run = make(n)
                firsts.append(timed(run))
                repeats.append(min(timed(run) for _ in range(3)))
        except RuntimeError as exc:
            return {"error": str(exc).splitlines()[0][:200]}
        return {"first_ms": firsts, "repeat_ms": repeats}

    b, hkv, group, dh = (4, 2, 2, 32) if tiny else (32, 8, 4, 128)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=torch.bfloat16, device=device)

    def decode(length: int) -> Any:
        q = rand(b, hkv, group, dh)
        k, v = rand(b, hkv, length, dh), rand(b, hkv, length, dh)
        mask = torch.ones(b, 1, 1, length, dtype=torch.bool, device=device)
        return lambda: sdpa(q, k, v, attn_mask=mask)

    def chunk(n: int, repeat: bool) -> Any:
        ctx = 4 * n + n
        q = rand(1, hkv * group, n, dh)
        k, v = rand(1, hkv, ctx, dh), rand(1, hkv, ctx, dh)
        later = (
            torch.arange(ctx, device=device)[None, :]
            > torch.arange(4 * n, ctx, device=device)[:, None]
        )
        mask = torch.zeros(later.shape, dtype=torch.bfloat16, device=device).masked_fill_(
            later, float("-inf")
        )
        if repeat:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return lambda: sdpa(q, k, v, attn_mask=mask)
        return lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

    lengths = (1040, 1056, 1072) if not tiny else (40, 56)
    chunks = (1024, 1040) if not tiny else (32, 48)
    found: dict[str, Any] = {}
    backends = {
        "default": None,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for name, backend in backends.items():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            found[f"decode sdpa, {name}"] = case(decode, lengths)
            found[f"chunk sdpa, mask + gqa, {name}"] = case(lambda n: chunk(n, False), chunks)
            found[f"chunk sdpa, mask + repeated kv, {name}"] = case(
                lambda n: chunk(n, True), chunks
            )
    hidden, inter = (128, 256) if tiny else (4096, 14336)
    w = rand(inter, hidden)

    def linear(m: int) -> Any:
        x = rand(m, hidden)
        return lambda: x @ w.t()

    found["linear"] = case(linear, (37, 41, 45))
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Driver:
    """Runs loads on the engine, one at a time, and keeps the steps each one logged."""

    def __init__(self, core: EngineCore, vocab: int, seed: int = 0) -> None:
        self.core = core
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.last = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab - 1) for _ in range(n)]

    def add(self, ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.core.add_request(ids, params).request_id

    def run(self) -> None:
        while self.core.has_unfinished_requests():
            self.core.step()

    def until(self, done: Any) -> None:
        while not done():
            self.core.step()

    def steps(self) -> list[dict[str, Any]]:
        """The steps logged since the last call."""
        found: list[dict[str, Any]] = self.core.step_log(self.last)["steps"]
        if found:
            self.last = found[-1]["seq"]
        return found


def loads(grid: Grid, capacity: int, max_len: int) -> list[tuple[str, Any]]:
    """Each load's label and what runs it (a function of the driver)."""
    found: list[tuple[str, Any]] = []
    for n in grid.prefill:
        if n + 1 <= max_len:
            found += [(f"prompt {n}", _single(n, warm)) for warm in (True, False)]
    prefix, new = grid.cached
    found.append((f"prompt {new} after a cached prefix of {prefix}", _cached(prefix, new)))
    for c in grid.contexts:
        for b in grid.batches:
            if b * (c + grid.answer + 64) <= capacity and c + grid.answer + 64 <= max_len:
                found.append((f"{b} x {c}", _batch(b, c, grid.answer)))
    for b in grid.riders:
        late = max(grid.late)
        if b * (16 + 8 * len(grid.late) + 64) + late + 64 <= capacity:
            found.append((f"{b} riding", _riding(b, grid.late)))
    return found


def _single(n: int, warm: bool = False) -> Any:
    """A prompt of ``n`` tokens; ``warm``: after one whose steps are not kept (a GPU's
    first step of a new size picks its kernels)."""

    def run(d: Driver) -> None:
        if warm:
            d.add(d.prompt(n), 1)
            d.run()
            d.steps()
        d.add(d.prompt(n), 1)
        d.run()

    return run


def _cached(prefix: int, new: int) -> Any:
    def run(d: Driver) -> None:
        head = d.prompt(prefix)
        d.add(head, 1)
        d.run()
        d.steps()  # the prefix's own prefill is not this load's point
        d.add(head + d.prompt(new), 1)
        d.run()

    return run


def _batch(b: int, c: int, answer: int) -> Any:
    def run(d: Driver) -> None:
        budget = d.core.scheduler.config.max_num_batched_tokens
        steps = answer + math.ceil(b * c / budget)  # all B decode together for ``answer``
        for _ in range(b):
            d.add(d.prompt(c), steps)
        d.run()

    return run


def _riding(b: int, late: tuple[int, ...]) -> Any:
    def run(d: Driver) -> None:
        riders = [d.add(d.prompt(16), 10_000) for _ in range(b)]
        sched = d.core.scheduler
        d.until(
            lambda: not sched.waiting and all(r.num_computed_tokens > 16 for r in sched.running)
        )
        for n in late:
            d.add(d.prompt(n), 1)
            for _ in range(8):  # decodes alone between the late prompts
                d.core.step()
        for rider in riders:
            d.core.abort(rider)
        d.run()

    return run


def summary(cal: Calibrated, config: LlamaConfig, roof: dict[str, float]) -> list[dict[str, Any]]:
    """Each point beside the roofs: a prefill's model FLOP/s (2 x parameters a token) as a
    share of the matmul roof, a decode's bytes (weights once, each sequence's KV) as a
    share of the copy roof."""
    params = config.num_params
    weight_bytes = 2 * params
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    rows = []
    for p in cal.points:
        row: dict[str, Any] = {"label": p.label, "kind": p.kind.value, "seconds": p.seconds}
        row["fitted_s"] = cal.step_seconds(p.shape)
        row["tokens"], row["seqs"] = p.shape.num_tokens, p.shape.num_seqs
        if p.kind == PointKind.PREFILL:
            flops = 2 * params * p.shape.num_tokens
            row["flops_share"] = flops / p.seconds / roof["matmul_bf16_flops"]
        if p.kind == PointKind.DECODE:
            moved = weight_bytes + kv_token * p.shape.kv_tokens
            row["bytes_share"] = moved / p.seconds / roof["copy_bytes_per_s"]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny random shape and grid")
    ap.add_argument(
        "--kv-cache-gib", type=float, default=None, help="KV cache memory (48; tiny 0.05)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no load starts after this")
    ap.add_argument(
        "--sdpa-backends",
        default=None,
        help="the SDPA backends the engine may use, e.g. flash,efficient,math (default: torch's)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--profile-out", type=Path, default=PROFILE)
    args = ap.parse_args()

    shape, grid = (TINY, TINY_GRID) if args.tiny else (LLAMA_8B, GPU_GRID)
    began = time.perf_counter()
    device = torch.device(args.device)
    roof = roofs(device, 1024 if args.tiny else 8192)
    print(
        f"roofs: bf16 matmul {roof['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s, "
        f"copy {roof['copy_bytes_per_s'] / 1e12:.2f} TB/s",
        flush=True,
    )
    costs = first_calls(device, args.tiny)
    for name, row in costs.items():
        print(f"first call: {name}: {row}", flush=True)
    if args.sdpa_backends:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
        names |= {"cudnn": "CUDNN_ATTENTION", "math": "MATH"}
        chosen = [getattr(SDPBackend, names[n]) for n in args.sdpa_backends.split(",")]
        sdpa_kernel(chosen).__enter__()  # for the whole run, the engine's calls too
    tokenizer = word_tokenizer(shape.vocab_size)
    loaded = random_model(shape, tokenizer, "bfloat16", args.device, name="llama-3.1-8b-random")
    max_len = 4096 + 2048 if args.tiny else 16384
    config = EngineConfig(
        max_model_len=min(max_len, shape.max_position_embeddings),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
        cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_gib or (0.05 if args.tiny else 48.0)),
    )
    core = EngineCore.from_loaded(loaded, config)
    driver = Driver(core, shape.vocab_size)
    settings = core.step_log()["engine"]
    capacity = settings["num_blocks"] * settings["block_size"]
    meta: dict[str, Any] = {
        "model": f"random {'tiny' if args.tiny else 'Llama-3.1-8B'}-shaped, bfloat16",
        "params": shape.num_params,
        "shape": asdict(shape),
        "device": settings.pop("device"),
        "dtype": settings.pop("dtype"),
        "engine": settings,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "roofs": roof,
        "first_calls": costs,
        "sdpa_backends": args.sdpa_backends or "torch's default",
    }
    print(f"engine: {meta['device']}, KV cache {capacity} tokens", flush=True)

    _single(64)(driver)  # warm-up: kernels chosen, allocator grown
    _batch(4, 64, 4)(driver)
    driver.steps()
    found: list[ProfilePoint] = []
    raw: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    skipped: list[str] = []
    for label, run in loads(grid, capacity, config.max_model_len or max_len):
        if time.perf_counter() - began > args.budget_s:
            skipped.append(label)
            continue
        try:
            run(driver)
        except Exception:
            errors[label] = traceback.format_exc()
            print(f"{label}: FAILED\n{errors[label]}", file=sys.stderr, flush=True)
            for request in list(core.scheduler.running):
                core.abort(request.request_id)
            driver.run()
            driver.steps()
            continue
        steps = driver.steps()
        raw.setdefault(label, []).extend(steps)
        for point in points(label, step_times(steps)):
            found.append(point)
            print(f"  {point.label}: {point.seconds * 1e3:.2f} ms", flush=True)
        write(args.out, meta, raw, found, errors, skipped, None, shape, roof)
    meta["skipped_for_time"] = skipped
    if device.type == "cuda":
        meta["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    cal = Calibrated.fit(found, meta) if len(found) >= 5 else None
    write(args.out, meta, raw, found, errors, skipped, cal, shape, roof)
    if cal is not None:
        cal.save(args.profile_out)
        for row in summary(cal, shape, roof):
            share = row.get("flops_share", row.get("bytes_share"))
            of = " of the matmul roof" if "flops_share" in row else " of the copy roof"
            print(
                f"{row['label']}: {row['seconds'] * 1e3:.2f} ms (fit {row['fitted_s'] * 1e3:.2f})"
                + (f", {share:.0%}{of}" if share is not None else "")
            )
        for kind in PointKind:
            err = cal.error(kind)
            if err:
                print(f"fit {kind.value}: mean {err.mean:.1%}, max {err.max:.1%} ({err.count})")
    print(f"{len(found)} points, {len(errors)} failed loads, {time.perf_counter() - began:.0f} s")
    return 1 if errors else 0


def write(
    path: Path,
    meta: dict[str, Any],
    raw: dict[str, list[dict[str, Any]]],
    found: list[ProfilePoint],
    errors: dict[str, str],
    skipped: list[str],
    cal: Calibrated | None,
    shape: LlamaConfig,
    roof: dict[str, float],
) -> None:
    """The results so far (written after every load: a run cut short keeps its steps)."""
    data: dict[str, Any] = {
        "format": "sendpath-gpu-step",
        "meta": meta,
        "points": [
            {"kind": p.kind.value, "label": p.label, "seconds": p.seconds, "steps": p.steps}
            | asdict(p.shape)
            for p in found
        ],
        "errors": errors,
        "skipped_for_time": skipped,
        "steps": raw,
    }
    if cal is not None:
        data["fit"] = {
            "coefficients_s": cal.coefficients,
            "error": {k.value: asdict(e) for k in PointKind if (e := cal.error(k))},
            "points": summary(cal, shape, roof),
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
