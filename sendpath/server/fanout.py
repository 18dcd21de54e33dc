"""The engine requests behind one response: ``n`` choices to one prompt, each its own
engine request, sampled independently, their outputs merged as they come.

The first choice's request goes alone; the others are added when it has its first output,
that is when its prompt is in the KV cache, so their prefill finds every full block of the
prompt in the prefix cache instead of computing it again (only the last, partial block is
each one's own). A seeded request gives choice i the seed ``seed + i``, so the n answers
differ and the same request gives the same n again (vLLM's rule).

One choice (n=1, nearly every request) is read straight from its stream, with no task or
queue between the engine and the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from sendpath.engine.async_engine import AsyncEngine, RequestStream
from sendpath.engine.outputs import EngineOutput
from sendpath.request import SamplingParams
from sendpath.server.protocol import ParsedRequest

__all__ = ["Fanout", "child_params"]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: the request's, with ``seed + index`` when seeded."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


class Fanout:
    """The n engine requests of one response and their merged outputs."""

    def __init__(self, engine: AsyncEngine, parsed: ParsedRequest) -> None:
        self.engine, self.parsed, self.n = engine, parsed, parsed.n
        self.traceparent: str | None = None  # the request's, for the replica's spans
        self.streams: list[RequestStream] = []
        self._queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def add(self, index: int) -> None:
        """Queue choice ``index`` in the engine (the first raises on a bad request)."""
        parsed = self.parsed
        stream = await self.engine.add(
            parsed.prompt,
            child_params(parsed.params, index),
            priority=parsed.priority,
            cache_salt=parsed.cache_salt,
            strict_max_tokens=parsed.max_tokens_given,
        )
        self.streams.append(stream)
        if self.n > 1:
            self._tasks.append(asyncio.create_task(self._pump(index, stream)))

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await self._queue.put((index, out))
        except Exception as exc:  # handed to the reader, which raises it
            await self._queue.put((index, exc))
        else:
            await self._queue.put((index, None))

    async def outputs(self) -> AsyncIterator[tuple[int, EngineOutput]]:
        """(choice, output) as they come, until every choice has ended; the other choices
        start with the first one's first output. What a stream raises is raised."""
        if self.n == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        ended = 0
        while ended < self.n:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                ended += 1
                continue
            if len(self.streams) == 1:
                for other in range(1, self.n):
                    await self.add(other)
            yield index, item

    def abort(self) -> None:
        """Stop every choice still running."""
        for stream in self.streams:
            if not stream.finished:
                stream.abort()
        for task in self._tasks:
            task.cancel()
