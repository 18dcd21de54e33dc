"""`sendpath profile --url`: calibrate from a live server, as it serves.

The in-process profile times the engine alone. A served engine shares the machine with
its HTTP server, the gateway and the clients, whose per-request and per-token work (the
filters, the tokenizer, SSE events through two processes) can slow its steps on a small
machine. So this drives a running `sendpath serve` (or one `sendpath replica`) with a
grid of loads, as clients would (streaming completions of text prompts, answers of fixed
length), and reads the replica's own record of every step it ran (``GET /v1/steps``): its shape
and its time. A step's time here is its period, start to the next step's start, when the
engine went straight on (that includes the loop's delivery of outputs between steps,
which is what the simulator's back-to-back steps stand for); else its own duration.

Prompts are text (common words, about a token each), so the gateway's filters and the
replica's tokenizer do the work they do for clients, on the same 2 cores as the engine.
Grid: single prompts of about N tokens (prefill chunks); B requests with prompts of
about C tokens: one first, the other B-1 at once as soon as it decodes (their prefill
chunks share steps with the decodes of those admitted first; then B decode, each answer
``answer`` tokens plus the steps the others' prompts take, so that the whole batch
decodes together for about ``answer`` steps); and B
short requests decoding while prompts of a few sizes come one at a time (one chunk with
B decodes of short context riding, the mixed steps of a chat server). Steps are
grouped per load and kind (prefill / decode / mixed) and shape size; each group's median
becomes a point, standing for the group's steps in the fit; every second mixed point is
held out to check it.

The machine's speed may drift while it does (on a shared host the same steps took up to
45% longer in some minutes than in others), and a load measured in a slow minute would
bend the fit. So a reference request (``reference``: a short prompt and a few tokens of
answer) runs before the first load and after each; a load's speed is the mean of the
reference steps' time before and after it. After the grid, a load that ran more than
``drift`` off the references' median is taken again (``retakes`` rounds at most), and
the take nearest the median is kept; ``meta`` lists the retaken loads and any still off.

Two things outside the steps go into the file's ``meta`` for the simulator: a lone
request's time to first token past its steps (``request_overhead_s``: HTTP, gateway,
tokenizer), and how often the gateway's output filter held an answer's first token back
until the next ones showed it could not start a blocked phrase (``first_token_hold``: the
share of answers held h tokens). That is a matter of what the model says, so it is read
from chat answers to prompts of common words (``chats`` of them, one at a time, after the
grid, their steps not fitted), as the gateway reports each (``first_token_held``; a
replica alone has no filter, and the file says ``None``).
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from typing import Any

import httpx

from sendpath.runner.cpu_step import CpuStepShape
from sendpath.sim.cost_model import Calibrated, PointKind, ProfilePoint
from sendpath.sim.served_loads import RIDER_PROMPT, LoadDriver, ServedProfileError

__all__ = [
    "DEFAULT_SERVED",
    "QUICK_SERVED",
    "ServedGrid",
    "profile_served",
    "step_kind",
    "step_times",
]


@dataclass(frozen=True)
class ServedGrid:
    prefill: tuple[int, ...]  # prompt tokens of single requests
    repeats: int  # of each single prompt
    batches: tuple[int, ...]  # B requests at once
    contexts: tuple[int, ...]  # of C prompt tokens each
    answer: int  # tokens of answer (B x C: plus the steps the other prompts take)
    chats: int = 16  # chat requests, one at a time, for the output filter's hold (not fitted)
    # B requests with short prompts decoding while prompts of each ``late`` size come one
    # at a time: mixed steps of one chunk and B decodes of short context, as a chat
    # server's are (the B x C loads' decodes all have C tokens of context)
    riders: tuple[int, ...] = ()
    late: tuple[int, ...] = ()
    reference: tuple[int, int] = (64, 9)  # prompt and answer tokens of the speed reference
    drift: float = 0.08  # a load whose references ran further off their median is retaken
    retakes: int = 2  # rounds of retakes at most

    def batch_answer(self, count: int, tokens: int, budget: int) -> int:
        """A B x C load's answer: ``answer`` plus the steps the other B - 1 prompts take
        to prefill (``budget`` prompt tokens a step), so all B decode together for about
        ``answer`` steps, not only as the batch ramps."""
        return self.answer + -(-(count - 1) * tokens // budget)


# about 4 minutes on 2 cores with the built-in model (more when loads are retaken)
DEFAULT_SERVED = ServedGrid(
    prefill=(16, 64, 128, 256, 512, 1024), repeats=3,
    batches=(1, 2, 4, 8, 16, 32, 64), contexts=(64, 512), answer=24,
    riders=(4, 16, 32), late=(32, 128, 384),
)  # fmt: skip
QUICK_SERVED = ServedGrid(
    prefill=(8, 32), repeats=2, batches=(1, 4), contexts=(16,), answer=32, chats=4,
    riders=(4,), late=(16,), reference=(16, 5),
)  # fmt: skip


def step_kind(shape: CpuStepShape) -> PointKind:
    """Decode (one-token steps only), prefill (prompt chunks only) or mixed."""
    if shape.prefills == 0 and shape.num_tokens == shape.num_seqs:
        return PointKind.DECODE
    if shape.num_seqs == 1 or shape.num_seqs == shape.prefills:
        return PointKind.PREFILL
    return PointKind.MIXED


@dataclass(frozen=True)
class _Take:
    """One run of a load: its points, a lone request's overhead, and its speed (the mean
    time of the reference requests just before and just after it)."""

    points: list[ProfilePoint]
    overhead: float | None
    reference_s: float


def off(take: _Take, usual_s: float) -> float:
    """How far the take's references ran from ``usual_s`` (the median of them all)."""
    return abs(take.reference_s / usual_s - 1) if usual_s > 0 else 0.0


def hold_shares(holds: list[int]) -> list[float] | None:
    """``SimConfig.first_token_hold`` from measured holds: the share held h tokens."""
    if not holds:
        return None
    return [holds.count(h) / len(holds) for h in range(max(holds) + 1)]


async def _steps(client: httpx.AsyncClient, replica: str, after: int) -> dict[str, Any]:
    r = await client.get(f"{replica.rstrip('/')}/v1/steps", params={"after": after})
    if r.status_code != 200:
        raise ServedProfileError(f"{replica} has no step log (GET /v1/steps: {r.status_code})")
    found: dict[str, Any] = r.json()
    return found


def step_times(steps: list[dict[str, Any]]) -> list[tuple[CpuStepShape, float]]:
    """Each logged step's shape and time (``GET /v1/steps``' records): its period when
    the next step followed at once."""
    out = []
    for step, nxt in zip(steps, [*steps[1:], None], strict=True):
        seconds = step["seconds"]
        if step["busy_after"] and nxt is not None and nxt["seq"] == step["seq"] + 1:
            seconds = max(seconds, nxt["start"] - step["start"])
        shape = CpuStepShape(**{f.name: int(step[f.name]) for f in fields(CpuStepShape)
                             if f.name in step})  # fmt: skip
        out.append((shape, seconds))
    return out


def _points(label: str, timed: list[tuple[CpuStepShape, float]]) -> list[ProfilePoint]:
    """One point per kind and size: the median step (by time) of each group."""
    groups: dict[tuple[PointKind, int, int], list[tuple[CpuStepShape, float]]] = defaultdict(list)
    for shape, seconds in timed:
        groups[(step_kind(shape), shape.num_seqs, shape.num_tokens)].append((shape, seconds))
    points = []
    for (kind, seqs, tokens), items in sorted(groups.items()):
        items.sort(key=lambda item: item[1])
        shape, seconds = items[len(items) // 2]
        name = f"{label}: {kind.value} {tokens} tok / {seqs} seq ({len(items)} steps)"
        points.append(ProfilePoint(kind, name, shape, seconds, len(items)))
    return points


def profile_served(
    url: str,
    api_key: str | None = None,
    grid: ServedGrid = DEFAULT_SERVED,
    progress: Callable[[ProfilePoint], None] = lambda p: None,
) -> Calibrated:
    """Drive the server at ``url`` through ``grid`` and fit its steps."""
    return asyncio.run(_profile(url, api_key, grid, progress))


async def _profile(
    url: str, api_key: str | None, grid: ServedGrid, progress: Callable[[ProfilePoint], None]
) -> Calibrated:
    started = time.perf_counter()
    driver = LoadDriver(url, api_key)
    async with driver.client:
        replica = await driver.replica()
        model = await driver.model()
        await driver.cache_preamble(model)  # and warms the server up
        seen = await _steps(driver.client, replica, 0)
        engine: dict[str, Any] = seen["engine"]
        last = seen["steps"][-1]["seq"] if seen["steps"] else 0
        capacity = engine["num_blocks"] * engine["block_size"]
        skipped: list[str] = []
        # single prompts, every second one after a cached prefix (its chunk resumes there)
        loads = [
            (f"prompt {n}" + (" after a cached prefix" if r % 2 else ""), 1, n, 1, r % 2 == 1)
            for n in grid.prefill
            for r in range(grid.repeats)
        ]
        budget = engine["max_num_batched_tokens"]
        loads += [
            (f"{b} x {c}", b, c, grid.batch_answer(b, c, budget), False)
            for c in grid.contexts
            for b in grid.batches
        ]
        # riders outlast the late prompts (each a few of their steps, sent one at a time)
        ride = grid.answer + 8 * len(grid.late)
        loads += [(f"{b} riding", b, RIDER_PROMPT, ride, False) for b in grid.riders]
        runnable = []
        for label, count, tokens, answer, cached_prefix in loads:
            riding = label.endswith("riding")  # and one late prompt at a time
            late = max(grid.late, default=0) + 2 if riding else 0  # its tokens
            size = count * (tokens + answer + 16) + (late + 16 if late else 0)
            if (
                count + riding > engine["max_num_seqs"]
                or size > capacity
                or (max(tokens + answer, late) > engine["max_model_len"])
            ):
                skipped.append(label)
            else:
                runnable.append((label, count, tokens, answer, cached_prefix))
        references: list[float] = []  # seconds the reference request's steps took, each time
        takes: list[list[_Take]] = [[] for _ in runnable]  # each load's (repeats apart)

        async def logged() -> list[tuple[CpuStepShape, float]]:
            nonlocal last
            found = await _steps(driver.client, replica, last)
            if found["steps"]:
                last = found["steps"][-1]["seq"]
            return step_times(found["steps"])

        async def reference() -> float:
            await driver.one(model, *grid.reference)
            references.append(sum(seconds for _, seconds in await logged()))
            return references[-1]

        async def take(i: int) -> None:
            label, count, tokens, answer, cached = runnable[i]
            before, again = references[-1], bool(takes[i])
            if cached and again:  # the loads since may have evicted the preamble
                await driver.cache_preamble(model)
                await logged()
            if label.endswith("riding"):
                ttft = 0.0
                await driver.riders(model, count, grid.late, answer)
            elif count == 1:
                ttft = await driver.one(model, tokens, answer, cached_prefix=cached)
            else:
                ttft = await driver.load(model, count, tokens, answer)
            timed = await logged()
            # the request alone: its steps are its prefill, the rest of its time overhead
            overhead = ttft - sum(s for _, s in timed) if count == 1 and answer == 1 else None
            points = _points(label, timed)
            takes[i].append(_Take(points, overhead, (before + await reference()) / 2))
            for p in points:
                progress(replace(p, label=f"{p.label} (retaken)") if again else p)

        await reference()
        for i in range(len(runnable)):
            await take(i)
        for _ in range(grid.retakes):  # loads taken while the machine ran off its usual speed
            usual = statistics.median(references)
            for i, found in enumerate(takes):
                if min(off(t, usual) for t in found) > grid.drift:
                    await take(i)
        usual = statistics.median(references)
        kept = [min(found, key=lambda t: off(t, usual)) for found in takes]
        points = [p for k in kept for p in k.points]
        overheads = [k.overhead for k in kept if k.overhead is not None]
        # chat answers, one at a time (steady gaps between tokens): how often the output
        # filter holds a first token back, a property of the model's answers and the rules
        for _ in range(grid.chats):
            words = driver.rng.randint(40, 120)
            await driver.one(model, words, max(2, grid.answer), chat=True)
    meta = {
        "model": model,
        "served_at": url,
        "device": f"served: {engine.pop('device', 'unknown device')}",
        "dtype": engine.pop("dtype", None),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "engine": engine,
        "grid": {
            "name": "served",
            "answer": grid.answer,
            "repeats": grid.repeats,
            # B x C loads: answer plus the steps the other prompts take to prefill
            "batch_answers": {load[0]: load[3] for load in runnable if " x " in load[0]},
        },
        "skipped": skipped,
        # what a request spends outside the engine's steps on its way in and its first
        # token's way out (HTTP, gateway, tokenizer, stream): the median over lone prompts
        "request_overhead_s": statistics.median(overheads) if overheads else None,
        # the output filter's hold on chat answers' first tokens (SimConfig.first_token_hold)
        "first_token_hold": hold_shares(driver.holds),
        "first_token_hold_answers": len(driver.holds),
        # the speed reference: its median time, and the loads taken again as it drifted
        "reference": {
            "prompt": grid.reference[0],
            "answer": grid.reference[1],
            "median_s": usual,
            "times": len(references),
        },
        "retaken": [load[0] for load, found in zip(runnable, takes, strict=True) if len(found) > 1],
        # [label, references' time over their median] for loads still off after retakes
        "drifted": [
            [load[0], round(k.reference_s / usual, 3)]
            for load, k in zip(runnable, kept, strict=True)
            if off(k, usual) > grid.drift
        ],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return Calibrated.fit(points, meta)
