"""Calibrate from the engine's own step log: run a grid of loads, fit the steps it logged.

The engine logs every step it runs (``EngineCore.steps``: the step's shape and wall time;
a replica serves the log as ``GET /v1/steps``). `sendpath profile` runs the grid's loads
on the engine `sendpath replica` builds from the same flags, in this process;
`sendpath profile --url` sends the same loads to a running server (``profile_served.py``).
The loads, as a server meets them:

- single prompts of N tokens, every second one after a cached prefix (``PREAMBLE``
  tokens a short request cached first): its chunk resumes there, as a chat request's
  does after its system prompt;
- B requests of C tokens: one first, the others once it decodes (their prefill chunks
  beside its decodes), each answer long enough that all B then decode together for
  about ``answer`` steps;
- B short requests decoding while prompts of each ``late`` size come one at a time (a
  chat server's mixed steps).

A step's time is its period, up to the next step's start when the engine went straight
on (what the simulator's back-to-back steps stand for). Each load's steps are grouped by
kind and size; a group's median step is a point standing for its steps in the fit. Loads
that do not fit the engine are skipped and listed in ``meta``.

Nothing here checks what else the machine runs: profile on an idle machine. A process
that shares the cores slows every step it overlaps (on a shared host the same steps took
up to 45% longer some minutes than others), and the fit takes that for the engine's cost.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from sendpath.config import EngineConfig
from sendpath.engine.core import EngineCore
from sendpath.engine.steps import StepShape
from sendpath.request import SamplingParams
from sendpath.sim.calibrated import Calibrated, PointKind, ProfilePoint

__all__ = [
    "DEFAULT_GRID",
    "PREAMBLE",
    "QUICK_GRID",
    "RIDER_PROMPT",
    "WARM_UP",
    "Grid",
    "Load",
    "loads",
    "meta",
    "points",
    "profile",
    "step_kind",
    "step_times",
]

PREAMBLE = 32  # tokens (words, over HTTP) of the shared prompt start: two KV blocks
RIDER_PROMPT = 16  # tokens of a riding request's prompt


@dataclass(frozen=True)
class Grid:
    prefill: tuple[int, ...]  # prompt tokens of single requests
    repeats: int  # of each single prompt
    batches: tuple[int, ...]  # B requests at once
    contexts: tuple[int, ...]  # of C prompt tokens each
    answer: int  # tokens of answer (B x C: plus the steps the other prompts take)
    riders: tuple[int, ...] = ()  # B short requests decoding while ``late`` prompts come
    late: tuple[int, ...] = ()
    chats: int = 16  # --url: greedy chat answers for the output filter's hold (not fitted)


# about 2 minutes on 2 idle cores with the built-in model, over HTTP or in process
DEFAULT_GRID = Grid(
    prefill=(16, 64, 128, 256, 512, 1024),
    repeats=3,
    batches=(1, 2, 4, 8, 16, 32, 64),
    contexts=(64, 512),
    answer=24,
    riders=(4, 16, 32),
    late=(32, 128, 384),
)
QUICK_GRID = Grid(
    prefill=(8, 48),
    repeats=2,
    batches=(1, 4),
    contexts=(16,),
    answer=32,
    riders=(4,),
    late=(16,),
    chats=4,
)


@dataclass(frozen=True)
class Load:
    label: str
    count: int  # requests
    tokens: int  # prompt tokens each
    answer: int  # answer tokens each
    cached_prefix: bool = False  # the prompt starts with the cached preamble
    late: tuple[int, ...] = ()  # riders: prompts sent one at a time while they decode


# first, in process and over HTTP: warms the engine up and caches the preamble's blocks
WARM_UP = Load("warm-up and cache the preamble", 1, 8, 2, cached_prefix=True)


def loads(grid: Grid, engine: dict[str, Any]) -> tuple[list[Load], list[str]]:
    """The grid's loads that fit ``engine`` (its ``GET /v1/steps`` settings), and the
    labels of those that do not."""
    found = [
        Load(f"prompt {n}" + (" after a cached prefix" if r % 2 else ""), 1, n, 1, r % 2 == 1)
        for n in grid.prefill
        for r in range(grid.repeats)
    ]
    budget = engine["max_num_batched_tokens"]  # the other B - 1 prompts' steps, then ``answer``
    found += [
        Load(f"{b} x {c}", b, c, grid.answer + -(-(b - 1) * c // budget))
        for c in grid.contexts
        for b in grid.batches
    ]
    ride = grid.answer + 8 * len(grid.late)  # riders outlast the late prompts
    found += [Load(f"{b} riding", b, RIDER_PROMPT, ride, late=grid.late) for b in grid.riders]

    def fits(x: Load) -> bool:
        late = max(x.late, default=0) + 2
        size = x.count * (x.tokens + x.answer + 16) + (late + 16 if x.late else 0)
        seqs, blocks = int(engine["max_num_seqs"]), int(engine["num_blocks"])
        return (
            x.count + bool(x.late) <= seqs
            and size <= blocks * int(engine["block_size"])
            and max(x.tokens + x.answer, late) <= int(engine["max_model_len"])
        )

    return [x for x in found if fits(x)], [x.label for x in found if not fits(x)]


def step_kind(shape: StepShape) -> PointKind:
    """Decode (one-token steps only), prefill (prompt chunks only) or mixed."""
    if shape.prefills == 0 and shape.num_tokens == shape.num_seqs:
        return PointKind.DECODE
    if shape.num_seqs == 1 or shape.num_seqs == shape.prefills:  # 1: logs before prefills
        return PointKind.PREFILL
    return PointKind.MIXED


def step_times(steps: list[dict[str, Any]]) -> list[tuple[StepShape, float]]:
    """Each logged step's shape and time (``GET /v1/steps``' records): its period when
    the next step followed at once."""
    out = []
    for step, nxt in zip(steps, [*steps[1:], None], strict=True):
        seconds = step["seconds"]
        if step["busy_after"] and nxt is not None and nxt["seq"] == step["seq"] + 1:
            seconds = max(seconds, nxt["start"] - step["start"])
        out.append((StepShape(**{f.name: int(step[f.name]) for f in fields(StepShape)}), seconds))
    return out


def points(label: str, timed: list[tuple[StepShape, float]]) -> list[ProfilePoint]:
    """One point per kind and size: the median step (by time) of each group."""
    groups: dict[tuple[PointKind, int, int], list[tuple[StepShape, float]]] = defaultdict(list)
    for shape, seconds in timed:
        groups[(step_kind(shape), shape.num_seqs, shape.num_tokens)].append((shape, seconds))
    found = []
    for (kind, seqs, tokens), items in sorted(groups.items()):
        shape, seconds = sorted(items, key=lambda item: item[1])[len(items) // 2]
        name = f"{label}: {kind.value} {tokens} tok / {seqs} seq ({len(items)} steps)"
        found.append(ProfilePoint(kind, name, shape, seconds, len(items)))
    return found


class _Engine:
    """Runs loads on an engine in this process, as a server's loop would step it."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.rng = core, random.Random(0)
        self.vocab = core.loaded.config.vocab_size if core.loaded else 32
        self.preamble = self.tokens(PREAMBLE)
        self.decoding: set[str] = set()  # requests that have a token out
        self.done: set[str] = set()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def send(self, tokens: int, answer: int, cached_prefix: bool = False) -> str:
        prompt = self.preamble + self.tokens(max(1, tokens - PREAMBLE)) if cached_prefix else []
        params = SamplingParams(max_tokens=answer, ignore_eos=True)
        return self.core.add_request(prompt or self.tokens(tokens), params).request_id

    def until(self, ids: list[str], state: set[str]) -> None:
        """Step until every one of ``ids`` is in ``state`` (``decoding`` or ``done``)."""
        while not state.issuperset(ids):
            if not self.core.has_unfinished_requests():
                raise RuntimeError(f"the engine dropped some of {ids}")
            for out in self.core.step():
                self.decoding.add(out.request_id)
                if out.finished:
                    self.done.add(out.request_id)

    def run(self, load: Load) -> None:
        first = [self.send(load.tokens, load.answer, load.cached_prefix)]
        if load.late:  # riders: all of them first, then each late prompt alone beside them
            first += [self.send(load.tokens, load.answer) for _ in range(load.count - 1)]
            self.until(first, self.decoding)
            for tokens in load.late:
                self.until([self.send(tokens, 2)], self.done)
        elif load.count > 1:
            self.until(first, self.decoding)
            first += [self.send(load.tokens, load.answer) for _ in range(load.count - 1)]
        self.until(first, self.done)


def profile(
    config: EngineConfig,
    grid: Grid = DEFAULT_GRID,
    progress: Callable[[ProfilePoint], None] = lambda p: None,
) -> Calibrated:
    """Load the engine ``config`` describes, run ``grid``'s loads on it, fit its steps."""
    core = EngineCore.from_config(config)
    driver = _Engine(core)
    driver.run(WARM_UP)
    last = core.steps.last.seq if core.steps.last else 0
    engine: dict[str, Any] = core.step_log(last)["engine"]
    runnable, skipped = loads(grid, engine)
    found = []
    for load in runnable:
        driver.run(load)
        steps: list[dict[str, Any]] = core.step_log(last)["steps"]
        last = steps[-1]["seq"] if steps else last
        for point in points(load.label, step_times(steps)):
            progress(point)
            found.append(point)
    return Calibrated.fit(found, meta(core.model_name, engine, skipped=skipped))


def meta(
    model: str, engine: dict[str, Any], served_at: str | None = None, **more: Any
) -> dict[str, Any]:
    """What a profile measured: ``model`` on the engine ``GET /v1/steps`` describes (its
    device and dtype lifted out; ``served_at``: a server's URL), on this many cores, when."""
    settings = dict(engine)
    device = str(settings.pop("device", "unknown device"))
    return {
        "model": model,
        "device": f"served: {device}" if served_at else device,
        "dtype": settings.pop("dtype", None),
        "cpu_count": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "engine": settings,
        **({"served_at": served_at} if served_at else {}),
        **more,
    }
