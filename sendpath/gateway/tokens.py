"""What the gateway asks a replica about a prompt's tokens.

The gateway has no tokenizer of its own (it fronts any OpenAI-compatible server); the
replicas do, and answer vLLM's ``POST /tokenize`` and ``POST /detokenize``:

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

import itertools
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from sendpath.api.schema import ChatBody, CompletionBody, content_text
from sendpath.router.pool import ReplicaPool

__all__ = ["ReplicaText", "byte_bound"]

ASK_TIMEOUT_S = 10.0
TEMPLATE_ALLOWANCE = 64  # a chat template's own tokens: a default system prompt, say
PER_MESSAGE = 16  # a message's role and markers


def byte_bound(request: ChatBody | CompletionBody) -> int:
    """An upper bound on a prompt's tokens without a tokenizer (see the module docstring)."""
    if isinstance(request, ChatBody):
        size = sum(len(content_text(m.content).encode()) for m in request.messages)
        return size + PER_MESSAGE * len(request.messages) + TEMPLATE_ALLOWANCE
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt.encode()) + 2
    if prompt and isinstance(prompt[0], str):
        return sum(len(str(p).encode()) for p in prompt) + 2
    return len(prompt)


class ReplicaText:
    """Token questions for the replicas behind one gateway."""

    def __init__(self, pool: ReplicaPool, session: Callable[[], aiohttp.ClientSession]) -> None:
        self.pool, self.session = pool, session  # the proxy's pooled client
        self._turn = itertools.count()

    async def count(self, request: ChatBody | CompletionBody) -> int:
        """The prompt's tokens as the engine will count them (or ``byte_bound``)."""
        prompt = request.prompt if isinstance(request, CompletionBody) else None
        if prompt is not None and not isinstance(prompt, str):
            if prompt and isinstance(prompt[0], int):
                return len(prompt)  # token ids: already exact
            prompt = "".join(str(p) for p in prompt)
        if isinstance(request, ChatBody):
            body: dict[str, Any] = {
                "messages": [
                    {"role": m.role, "content": content_text(m.content)} for m in request.messages
                ]
            }
        else:
            body = {"prompt": prompt}
        found = await self._ask("/tokenize", body)
        count = found.get("count") if found is not None else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        return byte_bound(request)

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
                async with self.session().post(
                    endpoint.url + path,
                    data=json.dumps(body).encode(),
                    headers={**endpoint.headers, "content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S),
                ) as r:
                    if r.status == 200 and isinstance(found := json.loads(await r.read()), dict):
                        return found
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
        return None
