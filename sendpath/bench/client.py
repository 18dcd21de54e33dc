"""One streamed request, measured on the client as `vllm bench serve` measures it.

TTFT is the time from sending to the first text chunk; ITL the gaps between text chunks;
latency (E2E) the time to the last byte. When the server sends sendpath's ``timings``
(last chunk), they are kept, and ``network`` is what the client saw beyond the server's
own total: ``latency - timings.total`` (both directions of the wire, plus the client).
A sendpath gateway's ``first_token_held`` (how many more text chunks its output filter
held the first one for) is kept too.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from sendpath.api.sse import DONE, sse_data

__all__ = ["RequestResult", "stream_chat", "stream_request"]


@dataclass
class RequestResult:
    success: bool = False
    text: str = ""
    request_id: str | None = None
    replica: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, served from the prefix cache (usage)
    output_tokens: int = 0  # from usage when reported, else the number of text chunks
    ttft: float | None = None  # seconds
    itl: list[float] | array[float] = field(default_factory=list)  # the simulator's: arrays
    latency: float = 0.0
    start: float = 0.0  # perf_counter when sent (for throughput windows)
    finish_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # the server's, ms
    first_token_held: int | None = None  # a sendpath gateway's output filter's hold
    error: str | None = None
    status: int | None = None

    @property
    def network_ms(self) -> float | None:
        """Client-observed total minus the server's total (None if it reported none)."""
        total = self.timings.get("total")
        return None if total is None else round(self.latency * 1000 - total, 3)


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    api_key: str | None = None,
    on_text: Callable[[str], None] | None = None,
) -> RequestResult:
    """POST a streaming request (``stream`` and ``include_usage`` are set here);
    ``on_text`` sees each text chunk as it arrives."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = RequestResult(start=time.perf_counter())
    last = out.start
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            out.status = r.status_code
            out.request_id = r.headers.get("x-request-id")
            out.replica = r.headers.get("x-sendpath-replica")
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {r.status_code}: {_message(raw)}"
                out.latency = time.perf_counter() - out.start
                return out
            chunks = 0
            async for payload in sse_data(r.aiter_lines()):
                if payload == DONE:
                    out.success = out.error is None
                    break
                event = json.loads(payload)
                if "error" in event:
                    out.error = _message(json.dumps(event))
                    continue
                out.request_id = out.request_id or event.get("id")
                if isinstance(event.get("timings"), dict):
                    out.timings = event["timings"]
                if isinstance(event.get("first_token_held"), int):
                    out.first_token_held = event["first_token_held"]
                if event.get("usage"):
                    out.prompt_tokens = event["usage"].get("prompt_tokens")
                    details = event["usage"].get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
                    out.output_tokens = event["usage"].get("completion_tokens", chunks)
                for choice in event.get("choices") or []:
                    delta = choice.get("delta")
                    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if out.ttft is None:
                            out.ttft = now - out.start
                        else:
                            out.itl.append(now - last)
                        last = now
                        chunks += 1
                        out.text += text
                        if on_text is not None:
                            on_text(text)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
            if not out.output_tokens:
                out.output_tokens = chunks
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency = time.perf_counter() - out.start
    if out.error is not None:
        out.success = False
    return out


async def stream_chat(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int | None,
    api_key: str | None = None,
    on_text: Callable[[str], None] | None = None,
    **extra: Any,
) -> RequestResult:
    body: dict[str, Any] = {"model": model, "messages": messages, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return await stream_request(client, "/v1/chat/completions", body, api_key, on_text)


def _message(raw: str) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error.get("message") or error)
    except (ValueError, KeyError, TypeError):
        return raw[:200]
