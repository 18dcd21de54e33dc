"""`sendpath profile --url`: calibrate from a live server's own step log, as it serves.

A served engine shares the machine with its HTTP server, the gateway and the clients,
whose per-request and per-token work can slow its steps on a small machine. So this sends
the grid's loads (``profile.py``) to a running `sendpath serve --replicas 1` (or one
`sendpath replica`) as clients send them (``served_loads.py``: streamed text prompts) and
fits the steps the replica itself logged (``GET /v1/steps``). Profile on an idle machine:
nothing here checks whether something else slowed the server meanwhile.

Outside the steps, for the simulator: a lone request's time to first token past its
steps (``request_overhead_s``: HTTP, gateway, tokenizer, stream), and how often the
gateway's output filter held a chat answer's first token back until the next ones showed
it could not start a blocked phrase (``first_token_hold``: the share of answers held h
tokens, from ``chats`` greedy answers after the grid, not fitted; a replica alone has no
filter, and the file says ``None``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sendpath.sim.calibrated import Calibrated, ProfilePoint
from sendpath.sim.profile import DEFAULT_GRID, Grid, loads, points, step_times
from sendpath.sim.served_loads import LoadDriver

__all__ = ["profile_served"]


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
    driver: LoadDriver, url: str, grid: Grid, progress: Callable[[ProfilePoint], None]
) -> Calibrated:
    async with driver.client:
        model = await driver.connect()
        await driver.cache_preamble(model)  # and warms the server up
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
    holds = driver.holds
    meta = {
        "model": model, "served_at": url, "device": f"served: {engine.pop('device', '?')}",
        "dtype": engine.pop("dtype", None), "cpu_count": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "engine": engine,
        "skipped": skipped,
        # a request's time outside the engine's steps to its first token: the median
        "request_overhead_s": statistics.median(overheads) if overheads else None,
        # the share of chat answers whose first token the output filter held h tokens
        "first_token_hold": [holds.count(h) / len(holds) for h in range(max(holds) + 1)]
        if holds else None,
        "first_token_hold_answers": len(holds),
    }  # fmt: skip
    return Calibrated.fit(found, meta)
