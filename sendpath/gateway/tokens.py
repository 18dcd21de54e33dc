"""What the gateway knows of a prompt's tokens: estimates, and what it asks a replica.

``estimate_prompt_tokens`` reads the prompt's characters (``api.prompt.prompt_text``, the
text the router and the input filter read too). The gateway has no tokenizer of its own
(it fronts any OpenAI-compatible server); the replicas do, and answer vLLM's
``POST /tokenize`` and ``POST /detokenize``:

- ``count``: a prompt's exact token count, the chat template included, so a key with
  token limits reserves what its prompt really is. Characters / 4 (OpenAI's estimate) is
  off by a factor of ten for emoji or combining marks, so a key could otherwise get ten
  times its limit in concurrent requests. If no replica can count, the UTF-8 length plus
  a template allowance stands in: a byte-level or byte-fallback tokenizer makes at most
  one token of each byte.
- ``detokenize``: a token-id prompt's text, for the input filter.

Each asks the healthy replicas in turn, starting after the last one asked, and takes the
first answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from typing import Any

from sendpath.api.prompt import GenerationBody, message_texts, prompt_text, tools_text
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.gateway.upstream import UpstreamClient, UpstreamConnectionError
from sendpath.router.pool import ReplicaPool

__all__ = ["ReplicaText", "byte_bound", "estimate_prompt_tokens"]

ASK_TIMEOUT_S = 10.0
TEMPLATE_ALLOWANCE = 64  # a chat template's own tokens: a default system prompt, say
PER_MESSAGE = 16  # a message's role and markers
# what a template writes around the tools it shows: how to call them (Qwen's instructions
# are about 100 tokens; sendpath's own, for a template without tools, fewer), and per tool
TOOLS_ALLOWANCE, PER_TOOL = 256, 16


def estimate_prompt_tokens(request: GenerationBody) -> int:
    """Prompt tokens estimated from characters, as OpenAI's own rate limiter does:
    about 4 characters per token, plus 4 per chat message for the template's markup.
    Token-id prompts count exactly. Settling corrects the estimate with real usage."""
    text = prompt_text(request)
    if text is None:
        assert isinstance(request, CompletionBody)
        return len(request.prompt)
    overhead = 4 * len(request.messages) if isinstance(request, ChatBody) else 0
    return math.ceil(len(text) / 4) + overhead


def byte_bound(request: GenerationBody) -> int:
    """An upper bound on a prompt's tokens without a tokenizer (see the module docstring)."""
    texts = message_texts(request)
    if texts is None:
        assert isinstance(request, CompletionBody)
        return len(request.prompt)  # token ids
    size = sum(len(t.encode()) for t in texts)
    if isinstance(request, ChatBody):
        tools = TOOLS_ALLOWANCE + PER_TOOL * len(request.tools or []) if tools_text(request) else 0
        return size + PER_MESSAGE * len(request.messages) + TEMPLATE_ALLOWANCE + tools
    return size + 2


class ReplicaText:
    """Token questions for the replicas behind one gateway."""

    def __init__(self, pool: ReplicaPool, client: UpstreamClient) -> None:
        self.pool, self.client = pool, client  # the proxy's pooled client
        self._turn = itertools.count()

    async def count(self, request: GenerationBody) -> int:
        """The prompt's tokens as the engine will count them (or ``byte_bound``)."""
        if isinstance(request, CompletionBody) and message_texts(request) is None:
            return len(request.prompt)  # token ids: already exact
        ids = await self.tokens(request)
        return len(ids) if ids is not None else byte_bound(request)

    async def tokens(self, request: GenerationBody) -> list[int] | None:
        """The prompt's token ids as the engine will see them, the chat template included
        (``None``: no replica could say): what precise prefix routing hashes."""
        texts = None if isinstance(request, ChatBody) else message_texts(request)
        if isinstance(request, CompletionBody) and texts is None:
            return list(request.prompt)  # type: ignore[arg-type]  # token ids already
        if isinstance(request, ChatBody):  # as the chat renders them: tool calls, tools too
            body: dict[str, Any] = {
                "messages": [m.model_dump(exclude_none=True) for m in request.messages]
            }
            if tools_text(request) is not None:
                body["tools"] = [t.model_dump(exclude_none=True) for t in request.tools or []]
        else:
            assert texts is not None
            body = {"prompt": texts[0]}
        found = await self._ask("/tokenize", body)
        ids = found.get("tokens") if found is not None else None
        if isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids):
            return ids
        return None

    async def detokenize(self, ids: list[int]) -> str | None:
        """A token-id prompt's text (``None``: no replica could say)."""
        found = await self._ask("/detokenize", {"tokens": ids})
        text = found.get("prompt") if found is not None else None
        return text if isinstance(text, str) else None

    async def _ask(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        candidates = [e for e in self.pool.endpoints if e.healthy]
        if not candidates:
            return None
        start = next(self._turn) % len(candidates)
        for endpoint in candidates[start:] + candidates[:start]:
            try:
                async with asyncio.timeout(ASK_TIMEOUT_S):
                    r = await self.client.post(
                        endpoint.url + path,
                        json.dumps(body).encode(),
                        {**endpoint.headers, "content-type": "application/json"},
                    )
                    try:
                        raw = await r.read()
                    finally:
                        r.release()
                if r.status == 200 and isinstance(found := json.loads(raw), dict):
                    return found
            except (UpstreamConnectionError, TimeoutError, ValueError):
                continue
        return None
