"""One request's state as it passes through the gateway, and small ASGI helpers.

The outermost middleware puts a ``GatewayContext`` in the ASGI scope; each middleware
fills in its part (the key, the parsed body, the reservation) and times its stage on it,
and the proxy reports the usage it saw, so the rate limiter can settle with real numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Send

from sendpath.clock import Clock
from sendpath.errors import SendpathError
from sendpath.gateway.keys import ApiKey
from sendpath.server.responses import error_body
from sendpath.trace import Stage

__all__ = ["GatewayContext", "context", "estimate_prompt_tokens", "prompt_text", "send_error"]

SCOPE_KEY = "sendpath.gateway"
# The stages the gateway measures, in path order (the replica's stages go in between).
GATEWAY_STAGES = (
    Stage.GATEWAY_AUTH,
    Stage.GATEWAY_RATELIMIT,
    Stage.GATEWAY_SAFETY,
    Stage.GATEWAY_QUEUE,
    Stage.ROUTE,
)


@dataclass
class GatewayContext:
    """What the gateway knows about one request so far."""

    clock: Clock
    start: float
    spans: dict[Stage, float] = field(default_factory=dict)
    key: ApiKey | None = None  # None: keys are not required and none was sent
    cache_salt: str | None = None  # set under per-key prefix-cache isolation
    body: dict[str, Any] | None = None  # the parsed JSON body (POSTs to /v1/* only)
    prompt_tokens: int = 0  # the estimate reserved at admission
    usage: tuple[int, int] | None = None  # (prompt, completion) as the replica reported it
    streamed_chunks: int = 0  # text chunks relayed (the usage estimate if none is reported)
    first_token_at: float | None = None
    replica: str | None = None

    @contextmanager
    def span(self, stage: Stage) -> Iterator[None]:
        """Time the block and add it to ``stage``."""
        t0 = self.clock.now()
        try:
            yield
        finally:
            self.spans[stage] = self.spans.get(stage, 0.0) + self.clock.now() - t0

    def used_tokens(self) -> int:
        """Tokens this request consumed: as reported, else estimated from what was relayed."""
        if self.usage is not None:
            return sum(self.usage)
        return self.prompt_tokens + self.streamed_chunks if self.streamed_chunks else 0

    def timings_ms(self, upstream: dict[str, Any] | None = None) -> dict[str, float]:
        """The response's ``timings``: gateway stages, the replica's stages, ``stream``,
        then ``ttft`` and ``total`` measured here, where the client's request arrived (a
        whole answer keeps the replica's ``ttft``)."""

        def ms(seconds: float) -> float:
            return round(seconds * 1000, 3)

        out = {s.value: ms(self.spans[s]) for s in GATEWAY_STAGES if s in self.spans}
        for name, value in (upstream or {}).items():
            if name != "total" and isinstance(value, int | float):
                out[name] = value
        if Stage.STREAM in self.spans:
            out[Stage.STREAM.value] = ms(self.spans[Stage.STREAM])
        if self.first_token_at is not None:
            out["ttft"] = ms(self.first_token_at - self.start)
        if "ttft" in out:  # after the stages, as the replica orders it
            out["ttft"] = out.pop("ttft")
        out["total"] = ms(self.clock.now() - self.start)
        return out


def context(scope: MutableMapping[str, Any]) -> GatewayContext:
    """The request's context (the tracing middleware must have run)."""
    ctx: GatewayContext = scope["state"][SCOPE_KEY]
    return ctx


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request sends the model: message contents, or the completion prompt."""
    parts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts += [p for p in prompt if isinstance(p, str)]
    return "\n".join(str(p) for p in parts)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens estimated from characters, as OpenAI's own rate limiter does:
    about 4 characters per token, plus 4 per chat message for the template's markup.
    Token-id prompts count exactly. Settling corrects the estimate with real usage."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    messages = body.get("messages")
    overhead = 4 * len(messages) if isinstance(messages, list) else 0
    return math.ceil(len(prompt_text(body)) / 4) + overhead


async def send_error(send: Send, exc: SendpathError, headers: dict[str, str] | None = None) -> None:
    """Answer with OpenAI's error body (from a middleware, before any byte was sent)."""
    body = json.dumps(error_body(exc)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": raw})
    await send({"type": "http.response.body", "body": body})
