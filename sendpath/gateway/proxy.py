"""Forwarding a generation request to a replica and relaying its answer.

The body goes on as the client sent it, with two changes: under per-key isolation the
key's ``cache_salt`` replaces any the client set, and a stream always asks the replica for
usage (``stream_options.include_usage``) so the rate limiter can settle with real numbers;
the usage chunk reaches the client only if it asked for it.

A stream's opening events are held until its first token exists: until then a failing
replica only means trying another. After that the stream is relayed event by event. Text
goes through the output guard, which holds back only what could still become a blocked
phrase; a blocked stream ends with finish_reason ``content_filter`` (the replica is
disconnected, which aborts the request there). The last event carries the stitched
``timings`` and, under the output filter, ``first_token_held``: how many more text chunks
(tokens, nearly always) the first one waited for before it could go out. A replica that
fails after its first token yields an explicit SSE error event and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sendpath.errors import ServiceUnavailableError
from sendpath.gateway.chunks import (
    answer_text,
    chain,
    finished,
    numbers,
    read_head,
    text_of,
    with_text,
)
from sendpath.gateway.context import GatewayContext, context
from sendpath.gateway.safety import OutputGuard
from sendpath.router.policy import RouteRequest, route_request
from sendpath.router.pool import Endpoint
from sendpath.router.router import Router
from sendpath.server.responses import error_body, server_timing, sse

__all__ = ["Proxy"]

T = TypeVar("T")

# Response headers worth passing on from a replica.
_PASS_HEADERS = ("retry-after", "x-request-id")


@dataclass
class _Retry:
    """An attempt that did not answer: try another replica, else hand back ``response``."""

    response: Response | None = None


class Proxy:
    """Sends requests to replicas over one pooled HTTP client, retrying before the first
    token reaches the client (each replica at most once, within ``retry_deadline_s``)."""

    def __init__(
        self,
        router: Router,
        guard: Callable[[], OutputGuard] | None,
        timeout_s: float,
        retry_deadline_s: float,
        on_done: Callable[[GatewayContext], None] = lambda ctx: None,
    ) -> None:
        self.router = router
        self.on_done = on_done  # a request finished: record its trace and metrics
        self.guard = guard
        self.retry_deadline_s = retry_deadline_s
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def forward(self, request: Request) -> Response:
        """Forward one POST to ``/v1/chat/completions`` or ``/v1/completions``."""
        ctx = context(request.scope)
        assert ctx.body is not None
        body = dict(ctx.body)
        if ctx.cache_salt is not None:
            body["cache_salt"] = ctx.cache_salt
        streaming = body.get("stream") is True
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        wants_usage = options.get("include_usage") is True
        if streaming:
            body["stream_options"] = {**options, "include_usage": True}
        route = route_request(ctx.body, ctx.cache_salt)
        deadline = ctx.clock.now() + self.retry_deadline_s
        tried: set[int] = set()
        fallback: Response | None = None
        while tried == set() or ctx.clock.now() < deadline:
            endpoint = self.router.choose(route, tried)
            if endpoint is None:
                break
            tried.add(endpoint.index)
            ctx.replica = endpoint.url
            answer = await self._attempt(ctx, request, endpoint, body, wants_usage, route)
            if not isinstance(answer, _Retry):
                answer.headers["x-sendpath-replica"] = endpoint.url
                return answer
            fallback = answer.response or fallback
        if fallback is not None:
            return fallback
        raise ServiceUnavailableError(
            "No healthy replica could take the request"
            + (f" (tried {len(tried)})" if tried else "")
            + "; retry in a moment."
        )

    async def _attempt(
        self,
        ctx: GatewayContext,
        request: Request,
        endpoint: Endpoint,
        body: dict[str, Any],
        wants_usage: bool,
        route: RouteRequest,
    ) -> Response | _Retry:
        # The replica's arrival on this clock: its x-sendpath-clock header when that reading
        # falls inside this attempt (same host, same monotonic clock); otherwise the moment
        # the request body was sent (httpx's trace hook).
        t0 = sent = ctx.clock.now()

        async def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal sent
            if event.endswith("send_request_body.complete"):
                sent = ctx.clock.now()

        endpoint.in_flight += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                endpoint.in_flight -= 1

        url = endpoint.url + request.url.path
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", url, json=body, extensions={"trace": trace}),
                stream=True,
            )
        except httpx.HTTPError as exc:
            release()
            self.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Retry()
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in _PASS_HEADERS}
        ctx.replica_arrival = _arrival(upstream.headers, t0, ctx.clock.now(), sent)
        ctx.replica_request_id = upstream.headers.get("x-request-id")
        keep_open = False  # only a stream that started stays open, for the relay
        try:
            if upstream.status_code != 200:
                return self._refused(
                    endpoint, upstream.status_code, await upstream.aread(), headers
                )
            if body.get("stream") is not True:
                raw = await _unless_gone(upstream.aread(), request)
                if raw is None:  # the client left: closing the connection aborts it there
                    return Response(status_code=499)
                data = json.loads(raw)
                ctx.end = ctx.clock.now()
                self.router.succeeded(endpoint)
                self.router.answered(route, endpoint, answer_text(data))
                return self._answer(ctx, data, headers)
            lines = upstream.aiter_lines()
            head = await _unless_gone(read_head(lines), request)
            if head is None:
                return Response(status_code=499)
            keep_open = True
        except (httpx.HTTPError, StopAsyncIteration, ValueError) as exc:
            self.router.failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Retry()
        finally:
            if not keep_open:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                release()
        self.router.succeeded(endpoint)
        events = self._relay(ctx, upstream, lines, head, endpoint, wants_usage, release, route)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    def _refused(
        self, endpoint: Endpoint, status: int, raw: bytes, headers: dict[str, str]
    ) -> Response | _Retry:
        """A replica's error answer: the client's fault is final; busy or broken, retry."""
        response = Response(raw, status, headers, media_type="application/json")
        if status < 500 and status != 429:
            return response
        try:
            code = json.loads(raw)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if status >= 500 and code != "queue_full":
            self.router.failed(endpoint, f"HTTP {status}")
        return _Retry(response)

    def _answer(
        self, ctx: GatewayContext, data: dict[str, Any], headers: dict[str, str]
    ) -> JSONResponse:
        """A whole (non-streamed) answer: usage, the output check, merged timings."""
        u = data.get("usage") or {}
        ctx.usage = (int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)))
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if self.guard is not None and isinstance(text, str):
            guard = self.guard()
            released = guard.push(text) + guard.flush()
            if guard.blocked is not None:
                if isinstance(message, dict):
                    message["content"] = released
                else:
                    choice["text"] = released
                choice["finish_reason"] = "content_filter"
        ctx.response_id = data.get("id")
        ctx.replica_timings = numbers(data.get("timings"))
        ctx.end = ctx.clock.now()
        data["timings"] = ctx.timings_ms()
        headers["Server-Timing"] = server_timing(data["timings"])
        self.on_done(ctx)
        return JSONResponse(data, headers=headers)

    async def _relay(
        self,
        ctx: GatewayContext,
        upstream: httpx.Response,
        lines: AsyncIterator[str],
        head: list[str],
        endpoint: Endpoint,
        wants_usage: bool,
        release: Callable[[], None],
        route: RouteRequest,
    ) -> AsyncIterator[str]:
        guard = self.guard() if self.guard is not None else None
        tail: list[dict[str, Any]] = []  # the finish chunk and usage chunk, held for timings
        upstream_timings: dict[str, Any] | None = None
        answer: list[str] = []  # what the replica generated (and now has cached)

        def finish() -> list[str]:
            events = [c for c in tail if c.get("choices") or wants_usage]
            ctx.replica_timings = numbers(upstream_timings)
            ctx.end = ctx.clock.now()
            if events:
                events[-1]["timings"] = ctx.timings_ms()
                if ctx.first_token_held is not None:
                    events[-1]["first_token_held"] = ctx.first_token_held
            self.on_done(ctx)
            return [sse(c) for c in events] + ["data: [DONE]\n\n"]

        try:
            async for line in chain(head, lines):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    self.router.answered(route, endpoint, "".join(answer))
                    for event in finish():
                        yield event
                    return
                chunk = json.loads(payload)
                ctx.response_id = ctx.response_id or chunk.get("id")
                if "error" in chunk:  # the replica's own error event: pass it on, no [DONE]
                    self.router.failed(endpoint, "an error event mid-stream")
                    yield sse(chunk)
                    return
                upstream_timings = chunk.pop("timings", None) or upstream_timings
                if chunk.get("usage"):
                    u = chunk["usage"]
                    ctx.usage = (int(u["prompt_tokens"]), int(u["completion_tokens"]))
                choices = chunk.get("choices") or []
                if not choices:
                    tail.append(chunk)
                    continue
                text, reason = text_of(choices[0]), choices[0].get("finish_reason")
                out: list[dict[str, Any]] = []
                if text:
                    answer.append(text)
                    ctx.streamed_chunks += 1
                    released = guard.push(text) if guard is not None else text
                    if guard is not None and guard.blocked is not None:
                        tail[:] = [finished(chunk, "content_filter")]
                        if wants_usage and ctx.usage is None:
                            tail.append(self._estimated_usage(chunk, ctx))
                        for event in finish():
                            yield event
                        return
                    if released:
                        out.append(with_text(chunk, released))
                if reason is not None:
                    rest = guard.flush() if guard is not None else ""
                    if rest:
                        out.append(with_text(chunk, rest))
                    tail.append(finished(chunk, reason) if text else chunk)
                elif not text:
                    out.append(chunk)  # the role chunk
                for c in out:
                    if text_of(c["choices"][0]):
                        ctx.relayed.append(ctx.clock.now())
                        if ctx.first_token_at is None:
                            ctx.first_token_at = ctx.relayed[-1]
                            if guard is not None:
                                ctx.first_token_held = ctx.streamed_chunks - 1
                    yield sse(c)
            why = "the replica closed the stream before [DONE]"
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            release()
        self.router.failed(endpoint, why)
        yield sse(self._broken(endpoint, why))

    @staticmethod
    def _estimated_usage(chunk: dict[str, Any], ctx: GatewayContext) -> dict[str, Any]:
        prompt, completion = ctx.prompt_tokens, ctx.streamed_chunks
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**chunk, "choices": [], "usage": usage}

    @staticmethod
    def _broken(endpoint: Endpoint, why: str) -> dict[str, Any]:
        return error_body(
            ServiceUnavailableError(
                f"The replica at {endpoint.url} failed mid-stream ({why}); the answer is "
                "incomplete. Retry the request."
            )
        )


def _arrival(headers: httpx.Headers, start: float, now: float, sent: float) -> float:
    """When the replica got the request, on this process's clock."""
    try:
        reported = float(headers.get("x-sendpath-clock", "nan"))
    except ValueError:
        return sent
    return reported if start <= reported <= now else sent


async def _unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """The result of ``work``, or ``None`` if the client disconnected first (then
    ``work`` is cancelled; closing the upstream connection aborts the request there)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None
