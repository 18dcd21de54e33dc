"""``n`` answers to one prompt: one engine request per choice, sampled independently.

The first choice's request goes alone; the others are added when it has its first token,
that is when its prompt is in the KV cache, so their prefill finds every full block of the
prompt in the prefix cache instead of computing it again (only the last, partial block is
each one's own). A seeded request gives choice i the seed ``seed + i``, so the n answers
differ and the same request gives the same n again (vLLM's rule).

The outputs of all choices are merged as they come; a client that leaves, or a choice that
fails, aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sendpath.api.errors import error_body
from sendpath.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from sendpath.engine.outputs import EngineOutput
from sendpath.errors import SendpathError, ServiceUnavailableError
from sendpath.request import SamplingParams, TokenLogprobs
from sendpath.server.generate import (
    ENGINE_STOPPED,
    answer_setup,
    collect_unless_gone,
    raise_unfinished,
)
from sendpath.server.protocol import ParsedRequest
from sendpath.server.responses import Chunker, LogprobRenderer, sse, timings_ms
from sendpath.server.tool_calls import CallParser, parser_for
from sendpath.trace import server_timing

if TYPE_CHECKING:
    from sendpath.server.app import Replica

__all__ = ["child_params", "serve_choices"]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: the request's, with ``seed + index`` when seeded."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


class _Fanout:
    """The n engine requests of one response and their merged outputs."""

    def __init__(self, engine: AsyncEngine, parsed: ParsedRequest) -> None:
        self.engine, self.parsed = engine, parsed
        self.streams: list[RequestStream] = []
        self._queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def add(self, index: int) -> None:
        parsed = self.parsed
        stream = await self.engine.add(
            parsed.prompt,
            child_params(parsed.params, index),
            priority=parsed.priority,
            cache_salt=parsed.cache_salt,
            strict_max_tokens=parsed.max_tokens_given,
        )
        self.streams.append(stream)
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
        start with the first one's first output."""
        ended = 0
        while ended < self.parsed.n:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                ended += 1
                continue
            if len(self.streams) == 1:
                for other in range(1, self.parsed.n):
                    await self.add(other)
            yield index, item

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                stream.abort()
        for task in self._tasks:
            task.cancel()


def _rendered(
    renderer: LogprobRenderer | None,
    chunker: Chunker,
    ids: list[int],
    logprobs: list[TokenLogprobs],
    offset: int = 0,
) -> dict[str, Any] | None:
    if renderer is None or not logprobs:
        return None
    if chunker.kind == "chat":
        return renderer.chat(ids, logprobs)
    return renderer.completion(ids, logprobs, offset)


async def serve_choices(
    replica: Replica, engine: AsyncEngine, parsed: ParsedRequest, request: Request
) -> Response:
    """Answer ``parsed`` (n > 1) whole or streamed."""
    fanout = _Fanout(engine, parsed)
    await fanout.add(0)  # a bad request is refused here, before anything is sent
    chunker, renderer, headers = answer_setup(replica, engine, parsed, fanout.streams[0].request)
    tools = [parser_for(parsed.tools, engine.core.tokenizer) for _ in range(parsed.n)]
    if parsed.stream:
        events = _events(replica, fanout, chunker, parsed.include_usage, renderer, tools)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    choices = await collect_unless_gone(
        replica, chunker.id, _collect(fanout, chunker, renderer, tools), request, fanout.abort
    )
    fanout.abort()  # nothing is left running: the pumps end
    if isinstance(choices, Response):
        return choices
    requests = [s.request for s in fanout.streams]
    for i, (stream, choice) in enumerate(zip(fanout.streams, choices, strict=True)):
        response_id = chunker.id if i == 0 else f"{chunker.id}-{i}"
        replica.finished(response_id, stream.request, choice["finish_reason"])
    body = chunker.whole(choices, requests)
    headers["Server-Timing"] = server_timing(body["timings"])
    return JSONResponse(body, headers=headers)


async def _collect(
    fanout: _Fanout,
    chunker: Chunker,
    renderer: LogprobRenderer | None,
    tools: list[CallParser | None],
) -> list[dict[str, Any]]:
    """Every choice whole, in index order."""
    n = fanout.parsed.n
    texts = [""] * n
    lasts: list[EngineOutput | None] = [None] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    try:
        async for index, out in fanout.outputs():
            texts[index] += out.text
            ids[index] += out.new_token_ids
            logprobs[index] += out.logprobs or []
            lasts[index] = out
    except EngineDeadError as exc:
        raise ServiceUnavailableError(ENGINE_STOPPED) from exc
    choices: list[dict[str, Any]] = []
    for i in range(n):
        last = lasts[i]
        if last is None:
            raise ServiceUnavailableError(ENGINE_STOPPED)
        raise_unfinished(last, chunker.id)
        rendered = _rendered(renderer, chunker, ids[i], logprobs[i])
        choices.append(chunker.choice(i, texts[i], str(last.finish_reason), rendered, tools[i]))
    return choices


async def _events(
    replica: Replica,
    fanout: _Fanout,
    chunker: Chunker,
    include_usage: bool,
    renderer: LogprobRenderer | None,
    tools: list[CallParser | None],
) -> AsyncIterator[str]:
    """SSE: a role chunk per choice, each choice's deltas (with its index) as they come,
    its finish chunk, then usage and [DONE]; or an error event (no [DONE])."""
    n = fanout.parsed.n
    sent = [0] * n
    reasons = [""] * n
    finals: list[dict[str, Any]] = []
    ended = False
    try:
        if chunker.kind == "chat":
            for i in range(n):
                yield sse(chunker.chunk("", role=True, index=i))
        async for index, out in fanout.outputs():
            rendered = _rendered(
                renderer, chunker, out.new_token_ids, out.logprobs or [], sent[index]
            )
            parser = tools[index]
            if parser is not None:
                deltas = parser.step(out.text, out.finished)
                for chunk in chunker.delta_chunks(deltas, rendered, index):
                    yield sse(chunk)
            elif out.text or rendered:
                yield sse(chunker.chunk(out.text, logprobs=rendered, index=index))
                sent[index] += len(out.text)
            if out.finished:
                raise_unfinished(out, chunker.id)
                reasons[index] = str(out.finish_reason)
                reason = reasons[index] if parser is None else parser.finish_reason(reasons[index])
                finals.append(chunker.chunk(None, reason, index=index))
        ended = True
        requests = [s.request for s in fanout.streams]
        for i, stream in enumerate(fanout.streams):
            response_id = chunker.id if i == 0 else f"{chunker.id}-{i}"
            replica.finished(response_id, stream.request, reasons[i])
        last = finals.pop()
        for final in finals:
            yield sse(final)
        if include_usage:
            yield sse(last)
            last = chunker.usage_chunk(*requests)
        last["timings"] = timings_ms(requests[0])
        yield sse(last)
        yield "data: [DONE]\n\n"
    except (EngineDeadError, SendpathError) as exc:
        ended = True
        replica.metrics.ended.labels("error").inc()
        if isinstance(exc, EngineDeadError):
            exc = ServiceUnavailableError(ENGINE_STOPPED)
        yield sse(error_body(exc))
    finally:
        replica.active.pop(chunker.id)
        fanout.abort()
        if not ended:
            replica.metrics.ended.labels("abort").inc()
