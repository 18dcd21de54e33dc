"""Answering a generation request: queue it in the engine (its ``n`` choices, each an
engine request: ``fanout.py``), then one JSON body or SSE. One representation serves both:
the stream of OpenAI chunks with n choices; a whole answer is those choices collected.

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
from sendpath.engine.async_engine import AsyncEngine, EngineDeadError
from sendpath.engine.outputs import EngineOutput, FinishReason
from sendpath.errors import (
    RequestFailedError,
    SendpathError,
    ServiceUnavailableError,
)
from sendpath.request import Request as EngineRequest
from sendpath.request import TokenLogprobs
from sendpath.server.fanout import Fanout
from sendpath.server.protocol import ParsedRequest
from sendpath.server.responses import Chunker, LogprobRenderer, sse, timings_ms
from sendpath.server.tool_calls import CallParser, parser_for
from sendpath.trace import server_timing

if TYPE_CHECKING:
    from sendpath.server.app import Replica

__all__ = ["ENGINE_STOPPED", "answer_setup", "collect_unless_gone", "serve_generation"]

logger = logging.getLogger("sendpath.replica")

ENGINE_STOPPED = "The engine stopped before this request finished; retry it."
T = TypeVar("T")


async def serve_generation(
    replica: Replica, engine: AsyncEngine, parsed: ParsedRequest, request: Request
) -> Response:
    """Queue ``parsed`` (for this replica's model, ``n`` choices) and answer it, streamed
    or whole: a whole answer is the stream's choices collected."""
    fanout = Fanout(engine, parsed)
    fanout.traceparent = request.headers.get("traceparent")  # continued in its spans
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
    _finished(replica, fanout, chunker, [c["finish_reason"] for c in choices])
    body = chunker.whole(choices, [s.request for s in fanout.streams])
    headers["Server-Timing"] = server_timing(body["timings"])
    return JSONResponse(body, headers=headers)


def _finished(replica: Replica, fanout: Fanout, chunker: Chunker, reasons: list[str]) -> None:
    """Each choice's request recorded (metrics, trace) under the response's id (``-i``
    after it for choice i > 0)."""
    for i, stream in enumerate(fanout.streams):
        response_id = chunker.id if i == 0 else f"{chunker.id}-{i}"
        replica.finished(response_id, stream.request, reasons[i])
    requests = [s.request for s in fanout.streams]
    replica.answered(fanout.parsed, requests, chunker.id, reasons, fanout.traceparent)


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


def _rendered(
    renderer: LogprobRenderer | None,
    chunker: Chunker,
    ids: list[int],
    logprobs: list[TokenLogprobs],
    offset: int = 0,
) -> dict[str, Any] | None:
    """OpenAI's logprobs object for these tokens (``offset``: the completion text's
    characters before them), or ``None`` where none were asked for."""
    if renderer is None or not logprobs:
        return None
    if chunker.kind == "chat":
        return renderer.chat(ids, logprobs)
    return renderer.completion(ids, logprobs, offset)


def _engine_stopped(response_id: str, exc: EngineDeadError) -> ServiceUnavailableError:
    logger.error("request %s: %s", response_id, exc)
    return ServiceUnavailableError(ENGINE_STOPPED)


async def _collect(
    fanout: Fanout,
    chunker: Chunker,
    renderer: LogprobRenderer | None,
    tools: list[CallParser | None],
) -> list[dict[str, Any]]:
    """Every choice whole, in index order (raises if one cannot finish)."""
    n = fanout.n
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
        raise _engine_stopped(chunker.id, exc) from exc
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
    fanout: Fanout,
    chunker: Chunker,
    include_usage: bool,
    renderer: LogprobRenderer | None,
    tools: list[CallParser | None],
) -> AsyncIterator[str]:
    """SSE: a role chunk per choice, then each choice's deltas as they come (one per text
    delta; per token, with its logprobs, when asked for; or as its tool-call parser cuts
    calls out of the text), its finish chunk, then usage and [DONE]; or an error event
    (and no [DONE]) if a choice cannot finish. Leaving early (the client went away, or
    was dropped for not reading) aborts every choice."""
    n = fanout.n
    sent = [0] * n  # characters of text streamed so far, per choice (completions' offsets)
    reasons = [""] * n
    finals: list[dict[str, Any]] = []
    ended = False  # finished or failed: anything else that ends this is an abort
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
            elif rendered is not None:
                yield sse(chunker.chunk(out.text, logprobs=rendered, index=index))
            elif out.text:
                yield chunker.delta_sse(out.text, index)
            sent[index] += len(out.text)
            if out.finished:
                raise_unfinished(out, chunker.id)
                reasons[index] = str(out.finish_reason)
                reason = reasons[index] if parser is None else parser.finish_reason(reasons[index])
                finals.append(chunker.chunk(None, reason, index=index))
        ended = True
        _finished(replica, fanout, chunker, reasons)
        requests = [s.request for s in fanout.streams]
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
            exc = _engine_stopped(chunker.id, exc)
        yield sse(error_body(exc))  # an explicit error event, and no [DONE]
    finally:
        replica.active.pop(chunker.id)
        fanout.abort()
        if not ended:
            replica.metrics.ended.labels("abort").inc()
