"""The loads `sendpath profile --url` sends: streamed requests as clients send them.

Text prompts (common words, about a token each), so that the gateway's filters and the
replica's tokenizer do the work they do for clients: one request; B at once, one first
and the rest once it decodes; B short requests decoding while prompts come one at a time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from sendpath.api.sse import sse_data
from sendpath.bench.workload import random_text

__all__ = ["PREAMBLE_WORDS", "RIDER_PROMPT", "LoadDriver", "ServedProfileError"]

RIDER_PROMPT = 16  # tokens of a riding request's prompt


PREAMBLE_WORDS = 32  # two KV blocks of a shared prompt start


class ServedProfileError(ValueError):
    """The server cannot be profiled (unreachable, several replicas, refuses requests)."""


class LoadDriver:
    """Sends the loads to ``url`` (a gateway with one replica, or a replica) and reads
    what the client sees: time to first token, and the output filter's holds."""

    def __init__(self, url: str, api_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600)
        self.rng = random.Random(0)
        self.preamble = random_text(random.Random(1), PREAMBLE_WORDS)
        self.holds: list[int] = []  # per answer: tokens the output filter held its first for

    async def replica(self) -> str:
        """The replica whose steps to read: the URL itself, or the gateway's only one."""
        try:
            r = await self.client.get("/fleet")
        except httpx.HTTPError as exc:
            raise ServedProfileError(f"cannot reach {self.client.base_url}: {exc}") from None
        if r.status_code != 200:
            return str(self.client.base_url)
        replicas = r.json()["replicas"]
        if len(replicas) != 1:
            raise ServedProfileError(
                f"the gateway has {len(replicas)} replicas; profile one (sendpath serve "
                "--replicas 1), so that every request's steps are on the replica read"
            )
        return str(replicas[0]["url"])

    async def model(self) -> str:
        r = await self.client.get("/v1/models")
        if r.status_code != 200:
            raise ServedProfileError(f"GET /v1/models said {r.status_code}: {r.text[:200]}")
        return str(r.json()["data"][0]["id"])

    async def one(
        self,
        model: str,
        prompt_tokens: int,
        answer: int,
        first: asyncio.Event | None = None,
        cached_prefix: bool = False,
        chat: bool = False,
    ) -> float:
        """One streamed request; ``first`` is set when its first token arrives. Returns the
        seconds from sending it to its first token, as a client sees them. Text, as
        clients send it (the gateway and the tokenizer run as they do in use): common
        words, about one token each; the step log has the exact counts. With
        ``cached_prefix`` it starts with the preamble every such prompt shares (as chat
        requests share a system prompt), whose blocks the prefix cache holds. With
        ``chat``, the prompt is a user message, and the answer's first-token hold (the
        output filter's) is kept in ``holds``."""
        sent, ttft = time.perf_counter(), 0.0
        if cached_prefix:
            rest = random_text(self.rng, max(1, prompt_tokens - 1 - PREAMBLE_WORDS))
            prompt = f"{self.preamble} {rest}"
        else:
            prompt = random_text(self.rng, max(1, prompt_tokens - 1))
        body: dict[str, Any] = {"model": model, "max_tokens": answer, "ignore_eos": True,
                                "temperature": 0, "stream": True}  # fmt: skip
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    raise ServedProfileError(
                        f"a request was refused ({r.status_code}): {text[:300]}"
                    )
                async for payload in sse_data(r.aiter_lines()):
                    if not ttft:
                        ttft = time.perf_counter() - sent
                        if first is not None:
                            first.set()
                    if chat and '"first_token_held"' in payload:  # the last event, a gateway's
                        self.holds.append(int(json.loads(payload)["first_token_held"]))
        finally:
            if first is not None:
                first.set()  # whoever waits for it goes on (and meets the error, if any)
        return ttft

    async def cache_preamble(self, model: str) -> None:
        """A short request that starts with the preamble, so that its blocks are cached
        for the ``cached_prefix`` requests after it."""
        await self.one(model, 8, 2, cached_prefix=True)

    async def load(self, model: str, count: int, prompt_tokens: int, answer: int) -> float:
        """``count`` requests: one first, the others once it decodes (so their prefills
        share steps with its decodes: mixed steps, whatever the token budget). Returns
        the first one's time to first token."""
        first = asyncio.Event()
        leader = asyncio.create_task(self.one(model, prompt_tokens, answer, first))
        if count > 1:
            await first.wait()
            await asyncio.gather(
                *(self.one(model, prompt_tokens, answer) for _ in range(count - 1))
            )
        return await leader

    async def riders(self, model: str, count: int, late: tuple[int, ...], answer: int) -> None:
        """``count`` short requests, then, once they all decode, one prompt of each
        ``late`` size at a time (two tokens of answer each), whose prefills ride with
        their decodes."""
        started = [asyncio.Event() for _ in range(count)]
        riding = [asyncio.create_task(self.one(model, RIDER_PROMPT, answer, first))
                  for first in started]  # fmt: skip
        await asyncio.gather(*(first.wait() for first in started))
        for tokens in late:
            await self.one(model, tokens, 2)
        await asyncio.gather(*riding)
