"""Calibrate from the engine's own step log: send a grid of loads, fit the steps it logged.

The engine logs every step it runs (``EngineCore.steps``: the step's shape and wall time;
a replica serves the log as ``GET /v1/steps``). `sendpath profile --url` sends the grid's
loads to a running server (`sendpath serve --replicas 1`, or one `sendpath replica`) as
its clients send them: streamed text prompts of common words, about a token each, so that
the gateway's filters and the replica's tokenizer do their work (the step log has the
exact counts). `sendpath profile` alone loads the engine `sendpath replica` builds from
the same flags and serves it in this process, on a loopback port, for the same loads
(``profile_driver.py`` sends them). The loads:

- single prompts of N tokens, every second one after a cached prefix (``PREAMBLE``
  tokens a short request cached first): its N tokens resume there, as a chat request's
  new tokens do after its system prompt;
- B requests of C tokens: one first, the others once it streams (their prefill chunks
  beside its decodes), each answer long enough that all B then decode together for
  about ``answer`` steps;
- B short requests decoding while prompts of each ``late`` size come one at a time (a
  chat server's mixed steps).

A step's time is its period, up to the next step's start when the engine went straight
on (what the simulator's back-to-back steps stand for). Each load's steps are grouped by
kind and size; a group's median step is a point standing for its steps in the fit. Loads
that do not fit the engine are skipped and listed in ``meta``.

Outside the steps, for the simulator: a lone request's time to first token past its
steps (``request_overhead_s``, the median: HTTP, gateway, tokenizer, stream), and how
often a gateway's output filter held a chat answer's first token back until the next
ones showed it could not start a blocked phrase (``first_token_hold``: the share of
answers held h tokens, from ``chats`` greedy answers after the grid, not fitted; a
replica alone has no filter, and the file says ``None``).

Nothing here checks what else the machine runs: profile on an idle machine. A process
that shares the cores slows every step it overlaps (on a shared host the same steps took
up to 45% longer some minutes than others), and the fit takes that for the engine's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import uvicorn

from sendpath.config import EngineConfig, ReplicaConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore
from sendpath.server.app import create_app
from sendpath.sim.calibrated import Calibrated, ProfilePoint, points, step_times
from sendpath.sim.profile_driver import PREAMBLE, WARM_UP, Load, LoadDriver

__all__ = [
    "DEFAULT_GRID",
    "QUICK_GRID",
    "Grid",
    "loads",
    "profile",
    "profile_served",
]

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
    chats: int = 16  # greedy chat answers for a gateway's output filter's hold (not fitted)


# about 2 minutes on 2 idle cores with the built-in model
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
        tokens = x.tokens + PREAMBLE * x.cached_prefix
        size = x.count * (tokens + x.answer + 16) + (late + 16 if x.late else 0)
        seqs, blocks = int(engine["max_num_seqs"]), int(engine["num_blocks"])
        return (
            x.count + bool(x.late) <= seqs
            and size <= blocks * int(engine["block_size"])
            and max(tokens + x.answer, late) <= int(engine["max_model_len"])
        )

    return [x for x in found if fits(x)], [x.label for x in found if not fits(x)]


def profile(
    config: EngineConfig,
    grid: Grid = DEFAULT_GRID,
    progress: Callable[[ProfilePoint], None] = lambda p: None,
) -> Calibrated:
    """Load the engine ``config`` describes, serve it in this process on a loopback port
    (the replica `sendpath replica` runs), send it ``grid``'s loads, fit its steps."""
    engine = AsyncEngine.build(lambda: EngineCore.from_config(config))
    app = create_app(ReplicaConfig(engine=config), engine)
    return asyncio.run(_serve_and_profile(app, grid, progress))


class _InProcess(uvicorn.Server):
    """Leaves Ctrl-C to the profile, which stops the server as it stops itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_and_profile(
    app: Any, grid: Grid, progress: Callable[[ProfilePoint], None]
) -> Calibrated:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = _InProcess(uvicorn.Config(app, log_level="warning", lifespan="on"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        url = "http://{}:{}".format(*sock.getsockname())
        try:
            return await _profile(LoadDriver(url, None), None, grid, progress)
        finally:
            server.should_exit = True
            await serving


def profile_served(
    url: str,
    api_key: str | None = None,
    grid: Grid = DEFAULT_GRID,
    progress: Callable[[ProfilePoint], None] = lambda p: None,
    replica_key: str | None = None,
) -> Calibrated:
    """Send ``grid``'s loads to the server at ``url`` and fit the steps it logged;
    ``replica_key``: the key the replica wants for them (`sendpath serve`'s replicas')."""
    return asyncio.run(_profile(LoadDriver(url, api_key, replica_key), url, grid, progress))


async def _profile(
    driver: LoadDriver, url: str | None, grid: Grid, progress: Callable[[ProfilePoint], None]
) -> Calibrated:
    async with driver.client:
        model = await driver.connect()
        await driver.run(model, WARM_UP)
        seen = await driver.steps(0)
        engine: dict[str, Any] = seen["engine"]
        last = seen["steps"][-1]["seq"] if seen["steps"] else 0
        runnable, skipped = loads(grid, engine)
        found: list[ProfilePoint] = []
        overheads = []
        for load in runnable:
            ttft = await driver.run(model, load)
            steps = (await driver.steps(last))["steps"]
            last = steps[-1]["seq"] if steps else last
            timed = step_times(steps)
            if load.count == 1 and load.answer == 1:  # a lone prompt: its steps, its prefill
                overheads.append(ttft - sum(seconds for _, seconds in timed))
            for point in points(load.label, timed):
                progress(point)
                found.append(point)
        for _ in range(grid.chats):  # one at a time, steady: how often the filter holds
            await driver.one(model, driver.rng.randint(40, 120), max(2, grid.answer), chat=True)
    holds, settings = driver.holds, dict(engine)
    return Calibrated.fit(
        found,
        {  # what it measured: the model, on the engine GET /v1/steps described, when
            "model": model,
            "device": str(settings.pop("device", "unknown device")),
            "dtype": settings.pop("dtype", None),
            "cpu_count": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "engine": settings,
            **({"served_at": url} if url else {}),  # a running server's
            "skipped": skipped,
            "request_overhead_s": statistics.median(overheads) if overheads else None,
            "first_token_hold": (
                [holds.count(h) / len(holds) for h in range(max(holds) + 1)] if holds else None
            ),
            "first_token_hold_answers": len(holds),
        },
    )
