"""Driving the load: a closed loop of C clients, or open-loop Poisson arrivals at R/s.

With ``rate``, conversations start at exponentially distributed intervals (a Poisson
process, seeded); ``concurrency`` then caps the requests in flight, as vLLM's
``--max-concurrency`` does. Without ``rate``, ``concurrency`` clients each take the next
conversation as soon as they are free. A conversation's turns run one after another, each
as soon as the previous answer is complete.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from sendpath.bench.client import RequestResult, stream_chat
from sendpath.bench.workload import Conversation

__all__ = ["Load", "run"]

MAX_OPEN = 2048  # connections of an open loop at most


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None
    rate: float | None = None  # requests (conversations) per second; None: closed loop
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None:
            raise ValueError("give --concurrency C, --rate R, or both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")


async def run(
    url: str,
    model: str,
    conversations: list[Conversation],
    load: Load,
    api_key: str | None = None,
    extra: dict[str, object] | None = None,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float]:
    """Run every conversation; returns the results and the wall time in seconds."""
    results: list[RequestResult] = []
    slots = asyncio.Semaphore(load.concurrency or 1_000_000)
    # open loop: a connection for every request that may be outstanding, so none waits for
    # one here (that wait would count as network); overloading a server needs hundreds
    connections = (load.concurrency or min(max(len(conversations), 256), MAX_OPEN)) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=3600, limits=limits) as client:

        async def converse(c: Conversation) -> None:
            for turn in range(len(c.turns)):
                async with slots:
                    r = await stream_chat(
                        client,
                        model,
                        c.messages(turn),
                        c.output_lens[turn],
                        api_key,
                        None,
                        **(extra or {}),
                    )
                results.append(r)
                on_done(r)
                if not r.success:
                    return  # the rest of this conversation has no history to build on
                c.answered(turn, r.text)

        start = time.perf_counter()
        if load.rate is None:
            queue = list(reversed(conversations))

            async def client_loop() -> None:
                while queue:
                    await converse(queue.pop())

            await asyncio.gather(*(client_loop() for _ in range(load.concurrency or 1)))
        else:
            rng = random.Random(load.seed)
            tasks = []
            for c in conversations:
                tasks.append(asyncio.create_task(converse(c)))
                await asyncio.sleep(rng.expovariate(load.rate))
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - start
