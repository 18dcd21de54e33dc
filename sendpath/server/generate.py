"""Answering a generation request: queue it in the engine, then one JSON body or SSE.

A client that goes away aborts its request wherever it is (queued, prefilling, decoding),
which frees its slot and KV blocks; a client that stops reading a stream is dropped by the
connection's write timeout (``api.http_server``), which does the same. A request the
engine could not compute ends with ``request_failed`` (500, or an error event in a stream)
and nothing else; an engine that stopped gives 503, its reason only in the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sendpath.api.disconnect import wait_disconnect
from sendpath.api.errors import error_body
from sendpath.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from sendpath.engine.outputs import EngineOutput, FinishReason
from sendpath.errors import (
    RequestFailedError,
    SendpathError,
    ServiceUnavailableError,
)
from sendpath.request import Request as EngineRequest
from sendpath.request import TokenLogprobs
from sendpath.server.protocol import ParsedRequest
from sendpath.server.responses import Chunker, LogprobRenderer, sse, timings_ms
from sendpath.server.tool_calls import CallParser, parser_for
from sendpath.trace import server_timing

if TYPE_CHECKING:
    from sendpath.server.app import Replica

__all__ = [
    "ENGINE_STOPPED",
    "answer_setup",
    "collect_unless_gone",
    "raise_unfinished",
    "serve_generation",
]

logger = logging.getLogger("sendpath.replica")

ENGINE_STOPPED = "The engine stopped before this request finished; retry it."
T = TypeVar("T")


async def serve_generation(
    replica: Replica, engine: AsyncEngine, parsed: ParsedRequest, request: Request
) -> Response:
    """Queue ``parsed`` (for this replica's model) and answer it (streamed or whole)."""
    stream = await engine.add(
        parsed.prompt,
        parsed.params,
        priority=parsed.priority,
        cache_salt=parsed.cache_salt,
        strict_max_tokens=parsed.max_tokens_given,
    )
    chunker, renderer, headers = answer_setup(replica, engine, parsed, stream.request)
    tools = parser_for(parsed.tools, engine.core.tokenizer)
    if parsed.stream:
        events = _events(replica, stream, chunker, parsed.include_usage, renderer, tools)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    result = await collect_unless_gone(
        replica, chunker.id, _collect(stream, chunker.id), request, stream.abort
    )
    if isinstance(result, Response):
        return result
    text, last, logprobs = result
    replica.finished(chunker.id, stream.request, str(last.finish_reason))
    rendered = None
    if renderer is not None:
        ids = stream.request.output_token_ids
        rendered = (
            renderer.chat(ids, logprobs)
            if chunker.kind == "chat"
            else renderer.completion(ids, logprobs)
        )
    body = chunker.body(text, last, stream.request, rendered, tools)
    headers["Server-Timing"] = server_timing(body["timings"])
    return JSONResponse(body, headers=headers)


def answer_setup(
    replica: Replica, engine: AsyncEngine, parsed: ParsedRequest, first: EngineRequest
) -> tuple[Chunker, LogprobRenderer | None, dict[str, str]]:
    """The response's chunker (and id), its logprob renderer where asked for, and its
    headers; ``first`` (the engine's request) is in flight under the response id."""
    prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
    chunker = Chunker(
        parsed.kind, f"{prefix}-{uuid.uuid4().hex}", replica.model_name, int(time.time())
    )
    renderer = None
    if parsed.params.logprobs is not None:
        renderer = LogprobRenderer(engine.core.tokenizer)
    # the engine's arrival on this host's monotonic clock: a gateway on the same host
    # stitches this replica's events into its own timeline exactly
    arrival = first.timeline.events[0].time
    headers = {"x-request-id": chunker.id, "x-sendpath-clock": repr(arrival)}
    replica.active.put(chunker.id, first)
    return chunker, renderer, headers


async def collect_unless_gone(
    replica: Replica,
    response_id: str,
    collect: Coroutine[Any, Any, T],
    request: Request,
    abort: Callable[[], None],
) -> T | Response:
    """``collect``'s result, or 499 if the client left first (then ``abort`` stops what
    the engine still runs for it); what ``collect`` raises is raised."""
    task = asyncio.create_task(collect)
    gone = asyncio.create_task(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        replica.active.pop(response_id)
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
            abort()
    if not task.done() or task.cancelled():
        replica.metrics.ended.labels("abort").inc()
        return Response(status_code=499)
    if (error := task.exception()) is not None:
        replica.metrics.ended.labels("error").inc()
        raise error
    return task.result()


def raise_unfinished(out: EngineOutput, response_id: str) -> None:
    """A last output that is not an answer: the request failed, or the engine stopped."""
    if out.finish_reason is FinishReason.ERROR:
        raise RequestFailedError(response_id)
    if out.finish_reason is FinishReason.ABORT:
        raise ServiceUnavailableError(ENGINE_STOPPED)


async def _collect(
    stream: RequestStream, response_id: str
) -> tuple[str, EngineOutput, list[TokenLogprobs]]:
    """The whole text, the last output, and every token's logprobs (where asked for)."""
    text, last, logprobs = "", None, []
    try:
        async for out in stream:
            text, last = text + out.text, out
            logprobs += out.logprobs or []
    except EngineDeadError as exc:
        logger.error("request %s: %s", response_id, exc)
        raise ServiceUnavailableError(ENGINE_STOPPED) from exc
    if last is None:
        raise ServiceUnavailableError(ENGINE_STOPPED)
    raise_unfinished(last, response_id)
    return text, last, logprobs


async def _events(
    replica: Replica,
    stream: RequestStream,
    chunker: Chunker,
    include_usage: bool,
    renderer: LogprobRenderer | None = None,
    tools: CallParser | None = None,
) -> AsyncIterator[str]:
    """SSE: a role chunk, one chunk per text delta (or per token, with its logprobs, when
    asked for; or as ``tools`` parses calls out of the text), the finish chunk, usage,
    [DONE]; or an error event (and no [DONE]) if the request cannot finish. Leaving early
    (the client went away, or was dropped for not reading) aborts the request."""
    ended = False  # finished or failed: anything else that ends this is an abort
    sent = 0  # characters of text streamed so far (completions' text_offset)
    try:
        if chunker.kind == "chat":
            yield sse(chunker.chunk("", role=True))
        async for out in stream:
            rendered = None
            if renderer is not None and out.logprobs:
                ids = out.new_token_ids
                rendered = (
                    renderer.chat(ids, out.logprobs)
                    if chunker.kind == "chat"
                    else renderer.completion(ids, out.logprobs, sent)
                )
            if tools is not None:
                for chunk in chunker.delta_chunks(tools.step(out.text, out.finished), rendered):
                    yield sse(chunk)
            elif rendered is not None:
                yield sse(chunker.chunk(out.text, logprobs=rendered))
                sent += len(out.text)
            elif out.text:
                yield chunker.delta_sse(out.text)
            if not out.finished:
                continue
            raise_unfinished(out, chunker.id)
            ended = True
            reason = str(out.finish_reason)
            replica.finished(chunker.id, stream.request, reason)
            final: dict[str, Any] = chunker.chunk(
                None, reason if tools is None else tools.finish_reason(reason)
            )
            timings = timings_ms(stream.request)
            if include_usage:
                yield sse(final)
                final = chunker.usage_chunk(stream.request)
            final["timings"] = timings
            yield sse(final)
            yield "data: [DONE]\n\n"
    except (EngineDeadError, SendpathError) as exc:
        ended = True
        replica.metrics.ended.labels("error").inc()
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: %s", chunker.id, exc)
            exc = ServiceUnavailableError(ENGINE_STOPPED)
        yield sse(error_body(exc))  # an explicit error event, and no [DONE]
    finally:
        replica.active.pop(chunker.id)
        if not stream.finished:
            stream.abort()
        if not ended:
            replica.metrics.ended.labels("abort").inc()
