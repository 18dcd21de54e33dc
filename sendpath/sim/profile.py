"""Time the real engine's steps on a grid and fit ``Calibrated`` to them.

What is timed is the wall time of one ``EngineCore.step()`` (schedule -> model forward ->
update), as the server's engine loop runs it, on the engine `sendpath replica` builds
from the same flags (model, dtype resolution, device, block size, KV-cache memory). Grid:

- prefill: one request's chunk of N tokens from position 0, and later chunks (N tokens
  from position S > 0) whose attention also reads the earlier context;
- decode: B requests at context C, one token each per step;
- mixed: B decodes plus one prefill chunk. Every second one is held out to check the fit
  (the others price the decodes riding beside a chunk).

Each point: one untimed warm-up step, then ``repeats`` timed ones; the median is kept. A
step during which other processes used the CPU is retaken (``sim/interference.py``).
Points that cannot run on this engine (a batch that does not fit the KV cache or
``max_num_seqs``, a context past ``max_model_len``) are skipped and listed in ``meta``.

Two liberties, both outside the timed step: (1) to reach a context without paying for its
prefill, the profiler runs the scheduler's bookkeeping alone (``schedule()`` + ``update()``
with a dummy token, no forward pass): blocks are allocated as for real and the cache
holds whatever was there, which changes no shape and no memory traffic, so no cost; (2) it
sets the step's token budget per point so the step has exactly the shape asked (the
server's budget only decides how prompts are cut into steps, not what a step costs).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sendpath.config import EngineConfig
from sendpath.engine.core import EngineCore
from sendpath.engine.scheduler import RunnerOutput
from sendpath.request import SamplingParams
from sendpath.sim.cost_model import Calibrated, CpuStepShape, PointKind, ProfilePoint
from sendpath.sim.interference import Interference

__all__ = ["DEFAULT_GRID", "QUICK_GRID", "Grid", "profile"]


@dataclass(frozen=True)
class Grid:
    """The steps to time; ``repeats`` timed steps per point (after one warm-up)."""

    prefill: tuple[tuple[int, int], ...]  # (chunk tokens, start position)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int, int], ...]  # (decodes, their context, chunk, its start)
    repeats: int = 5


# SmolLM2-135M in float32 on 2 idle CPU cores: about 75 s of timed steps, 1.5-2 minutes in all
DEFAULT_GRID = Grid(
    prefill=((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (1024, 0),
             (128, 512), (512, 512), (256, 1024), (64, 2048)),
    decode_batches=(1, 2, 4, 8, 16, 32, 64),
    decode_contexts=(64, 512, 1024, 2048),
    mixed=((4, 1024, 256, 0), (16, 512, 128, 0), (32, 128, 64, 0), (8, 256, 256, 512),
           (64, 64, 32, 0), (2, 2048, 512, 0)),
)  # fmt: skip
QUICK_GRID = Grid(
    prefill=((8, 0), (32, 0), (16, 32)),
    decode_batches=(1, 4),
    decode_contexts=(16, 64),
    mixed=((2, 32, 16, 0),),
    repeats=2,
)


Timed = tuple[float, CpuStepShape, bool]  # wall seconds, the step's shape, clean of neighbours
MAX_TRIES = 3  # timed steps per point at most, in repeats: past that, keep what was measured


class _Profiler:
    """Drives one engine through the grid; every request is aborted after its point.

    ``watch``: retake steps during which other processes used the CPU (``None``: keep all).
    """

    def __init__(self, core: EngineCore, grid: Grid, watch: Interference | None) -> None:
        self.core, self.grid, self.watch = core, grid, watch
        self.base = core.scheduler.config
        kv = core.scheduler.kv
        self.block_size, self.num_blocks = kv.block_size, kv.capacity_tokens // kv.block_size
        self.vocab = core.loaded.config.vocab_size if core.loaded else 32
        self.rng = random.Random(0)
        self.skipped: list[str] = []  # points this engine cannot run
        self.noisy: list[str] = []  # points with fewer than ``repeats`` clean steps
        self.retaken = 0
        # tokens a decode batch grows by while it is timed (warm-up + every try)
        tries = 1 + MAX_TRIES * grid.repeats
        self.decode_growth = len(grid.decode_batches) * tries + 2
        self.mixed_growth = 2 * tries + 2

    def fits(self, label: str, seqs: int, context: int, extra_tokens: int = 0) -> bool:
        """Whether ``seqs`` sequences of ``context`` tokens (+ one of ``extra_tokens``) fit."""
        blocks = seqs * -(-context // self.block_size) + -(-extra_tokens // self.block_size)
        longest = max(context, extra_tokens)
        ok = (
            seqs + (extra_tokens > 0) <= self.base.max_num_seqs
            and blocks <= self.num_blocks
            and longest < self.core.max_model_len
        )
        if not ok:
            self.skipped.append(label)
        return ok

    def add(self, length: int, max_tokens: int = 1) -> str:
        prompt = [self.rng.randrange(self.vocab) for _ in range(length)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return self.core.add_request(prompt, params).request_id

    @contextmanager
    def budget(self, tokens: int) -> Iterator[None]:
        """The scheduler's per-step token budget is ``tokens`` inside the block."""
        self.core.scheduler.config = replace(self.base, max_num_batched_tokens=tokens)
        try:
            yield
        finally:
            self.core.scheduler.config = self.base

    def advance(self, tokens: int) -> None:
        """One step of bookkeeping without the model (see the module docstring)."""
        with self.budget(tokens):
            plan = self.core.scheduler.schedule()
        sampled = {item.request_id: 0 for item in plan.requests if item.sample}
        self.core.scheduler.update(plan, RunnerOutput(sampled))

    def timed(self, tokens: int) -> Timed:
        """One real ``step()`` with a budget of ``tokens``: its wall time and shape."""
        watch = self.watch
        with self.budget(tokens):
            others = watch.others_s() if watch else 0.0
            start = time.perf_counter()
            self.core.step()
            seconds = time.perf_counter() - start
            others = watch.others_s() - others if watch else 0.0
        clean = watch is None or watch.clean(seconds, others)
        step = self.core.steps.last  # the engine's own record of the step it just ran
        assert step is not None
        return seconds, step.shape, clean

    def measure(self, kind: PointKind, label: str, once: Callable[[], Timed]) -> ProfilePoint:
        """One warm-up, then steps until ``repeats`` are clean (or ``MAX_TRIES`` x as many
        were tried): the median time; the shape of the middle one (they differ only by the
        tokens decodes add a step)."""
        once()
        clean: list[tuple[float, CpuStepShape]] = []
        every: list[tuple[float, CpuStepShape]] = []
        for _ in range(MAX_TRIES * self.grid.repeats):
            seconds, shape, ok = once()
            every.append((seconds, shape))
            if ok:
                clean.append((seconds, shape))
                if len(clean) == self.grid.repeats:
                    break
            elif self.watch is not None:
                self.retaken += 1
                self.watch.wait()
        if len(clean) < self.grid.repeats:
            self.noisy.append(label)
        runs = clean or every
        return ProfilePoint(
            kind, label, runs[len(runs) // 2][1], statistics.median(t for t, _ in runs)
        )

    def abort(self, ids: list[str]) -> None:
        for request_id in ids:
            self.core.abort(request_id)

    def chunk(self, tokens: int, start: int, decodes: int = 0) -> Timed:
        """A new request's chunk of ``tokens`` from ``start``, after ``decodes`` decodes."""
        request_id = self.add(start + tokens)
        if start:
            self.advance(decodes + start)  # decodes go first, then the prompt's first part
        timed = self.timed(decodes + tokens)
        self.abort([request_id])
        return timed

    def prefill(self, tokens: int, start: int) -> ProfilePoint | None:
        label = f"prefill {tokens} @ {start}"
        if not self.fits(label, 0, 0, start + tokens):
            return None
        return self.measure(PointKind.PREFILL, label, lambda: self.chunk(tokens, start))

    def decoders(self, count: int, context: int) -> list[str]:
        """``count`` requests at ``context`` tokens, each with one (dummy) token out."""
        max_tokens = self.core.max_model_len - context - 1
        ids = [self.add(context, max_tokens) for _ in range(count)]
        while any(self.core.scheduler.requests[i].num_computed_tokens < context for i in ids):
            self.advance(count * context)
        return ids

    def decodes(self, context: int) -> Iterator[ProfilePoint]:
        """Every batch size at ``context``, largest first, aborting down to the next."""
        sizes = [
            b for b in sorted(self.grid.decode_batches, reverse=True)
            if self.fits(f"decode {b} x {context}", b, context + self.decode_growth)
        ]  # fmt: skip
        if not sizes:
            return
        ids = self.decoders(sizes[0], context)
        for size in sizes:
            self.abort(ids[size:])
            ids = ids[:size]
            label = f"decode {size} x {context}"
            yield self.measure(PointKind.DECODE, label, partial(self.timed, size))
        self.abort(ids)

    def mixed(self, seqs: int, context: int, tokens: int, start: int) -> ProfilePoint | None:
        label = f"mixed {seqs} x {context} + {tokens} @ {start}"
        if not self.fits(label, seqs, context + self.mixed_growth, start + tokens):
            return None
        ids = self.decoders(seqs, context)
        point = self.measure(PointKind.MIXED, label, lambda: self.chunk(tokens, start, seqs))
        self.abort(ids)
        return point

    def run(self, progress: Callable[[ProfilePoint], None]) -> list[ProfilePoint]:
        g = self.grid
        warm = self.decoders(2, 32)  # first calls pay for allocations and kernel selection
        for _ in range(3):
            self.timed(2)
        self.abort(warm)
        found: list[ProfilePoint | None] = []
        for tokens, start in g.prefill:
            found.append(self.prefill(tokens, start))
            self._report(found[-1], progress)
        for context in g.decode_contexts:
            for p in self.decodes(context):
                found.append(p)
                progress(p)
        for spec in g.mixed:
            found.append(self.mixed(*spec))
            self._report(found[-1], progress)
        return [p for p in found if p is not None]

    @staticmethod
    def _report(p: ProfilePoint | None, progress: Callable[[ProfilePoint], None]) -> None:
        if p is not None:
            progress(p)


def profile(
    config: EngineConfig,
    grid: Grid = DEFAULT_GRID,
    progress: Callable[[ProfilePoint], None] | None = None,
    guard: bool = True,
) -> Calibrated:
    """Load the engine ``config`` describes, time ``grid`` on it, fit and return the model.

    ``guard``: retake steps during which other processes used the CPU (see
    ``sim/interference.py``); off, every step counts (deterministic shapes, for tests).
    """
    started = time.perf_counter()
    core = EngineCore.from_config(config)
    profiler = _Profiler(core, grid, Interference() if guard else None)
    points = profiler.run(progress or (lambda p: None))
    meta = _meta(core, config, grid)
    meta.update(
        skipped=profiler.skipped,
        noisy=profiler.noisy,
        retaken_steps=profiler.retaken,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return Calibrated.fit(points, meta)


def _meta(core: EngineCore, config: EngineConfig, grid: Grid) -> dict[str, Any]:
    from sendpath.runner.model_runner import ModelRunner

    assert core.loaded is not None and isinstance(core.runner, ModelRunner)
    runs_on = core.runner.describe()
    sched, kv = core.scheduler.config, core.scheduler.kv
    return {
        "model": core.model_name,
        "model_path": str(core.loaded.path),
        "dtype": runs_on["dtype"],
        "device": runs_on["device"],
        "torch": runs_on["torch"],
        "torch_threads": runs_on["torch_threads"],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "engine": {
            "max_model_len": core.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "block_size": kv.block_size,
            "num_blocks": kv.capacity_tokens // kv.block_size,
            "kv_cache_memory_gib": config.cache.kv_cache_memory_gib,
            "prefix_caching": kv.enable_prefix_caching,
        },
        "grid": {"name": "quick" if grid == QUICK_GRID else "default", "repeats": grid.repeats},
    }
