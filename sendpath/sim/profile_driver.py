"""What `sendpath profile` sends: a grid's loads, to a replica as its clients send them.

``LoadDriver`` sends each load (``profile.py`` makes them from the grid) as streamed text
prompts to a server (a gateway with one replica, or a replica), reads what a client
sees (time to first token, the output filter's hold on it) and the replica's own step
log (``GET /v1/steps``).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx

from sendpath.bench.client import stream_request
from sendpath.bench.workload import random_text

__all__ = ["PREAMBLE", "WARM_UP", "Load", "LoadDriver", "ServedProfileError"]

PREAMBLE = 32  # words (about a token each) of the shared prompt start: two KV blocks


@dataclass(frozen=True)
class Load:
    label: str
    count: int  # requests
    tokens: int  # prompt tokens each (after the cached preamble's, with cached_prefix)
    answer: int  # answer tokens each
    cached_prefix: bool = False  # the prompt resumes after the cached preamble
    late: tuple[int, ...] = ()  # riders: prompts sent one at a time while they decode


# first: warms the engine up and caches the preamble's blocks
WARM_UP = Load("warm-up and cache the preamble", 1, 8, 2, cached_prefix=True)


class ServedProfileError(ValueError):
    """The server cannot be profiled (unreachable, several replicas, refuses requests)."""


class LoadDriver:
    """Sends the loads to ``url`` (a gateway with one replica, or a replica), reads what
    the client sees (time to first token, the output filter's holds) and the replica's
    step log."""

    def __init__(self, url: str, api_key: str | None, replica_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # the replicas `sendpath serve` starts want its replica key on /v1/steps
        self.replica_headers = {"Authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600)
        self.rng = random.Random(0)
        self.preamble = random_text(random.Random(1), PREAMBLE)
        self.holds: list[int] = []  # per answer: tokens the output filter held its first for
        self.replica = str(self.client.base_url).rstrip("/")  # whose steps to read (``connect``)

    async def connect(self) -> str:
        """Find the replica whose steps to read (the URL itself, or the gateway's only
        one) and return the name of the model it serves."""
        try:
            r = await self.client.get("/fleet")
        except httpx.HTTPError as exc:
            raise ServedProfileError(f"cannot reach {self.client.base_url}: {exc}") from None
        if r.status_code == 200:
            replicas = r.json()["replicas"]
            if len(replicas) != 1:
                raise ServedProfileError(
                    f"the gateway has {len(replicas)} replicas; profile one (sendpath serve "
                    "--replicas 1), so that every request's steps are on the replica read"
                )
            self.replica = str(replicas[0]["url"]).rstrip("/")
        r = await self.client.get("/v1/models")
        if r.status_code != 200:
            raise ServedProfileError(f"GET /v1/models said {r.status_code}: {r.text[:200]}")
        return str(r.json()["data"][0]["id"])

    async def steps(self, after: int) -> dict[str, Any]:
        """The replica's step log after step ``after`` and its engine (``GET /v1/steps``)."""
        r = await self.client.get(
            f"{self.replica}/v1/steps",
            params={"after": after},
            headers=self.replica_headers or None,
        )
        if r.status_code == 401:
            raise ServedProfileError(
                f"{self.replica} wants its replica key for GET /v1/steps: give "
                "--replica-api-key (or $SENDPATH_REPLICA_API_KEY), as `sendpath serve` was given it"
            )
        if r.status_code != 200:
            raise ServedProfileError(
                f"{self.replica} has no step log (GET /v1/steps: {r.status_code})"
            )
        found: dict[str, Any] = r.json()
        return found

    async def one(
        self,
        model: str,
        tokens: int,
        answer: int,
        first: asyncio.Event | None = None,
        cached_prefix: bool = False,
        chat: bool = False,
    ) -> float:
        """One streamed request of about ``tokens`` words (the step log has the exact
        count), resuming after the cached preamble with ``cached_prefix``; a user message with
        ``chat``, whose first token's hold by the output filter goes in ``holds``. Sets
        ``first`` at its first token; returns the seconds to it, as the client saw them."""
        prompt = random_text(self.rng, max(1, tokens - 1))
        prompt = f"{self.preamble} {prompt}" if cached_prefix else prompt
        body: dict[str, Any] = {"model": model, "max_tokens": answer, "ignore_eos": True}
        body |= {"temperature": 0, "prompt": prompt}
        if chat:
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        first = first or asyncio.Event()
        try:
            found = await stream_request(self.client, path, body, on_text=lambda _: first.set())
        finally:
            first.set()  # whoever waits for it goes on (and meets the error, if any)
        if not found.success:
            raise ServedProfileError(f"a request failed: {found.error}")
        if chat and found.first_token_held is not None:  # a gateway's output filter held it
            self.holds.append(found.first_token_held)
        return found.ttft or 0.0

    async def run(self, model: str, load: Load) -> float:
        """Send ``load``; the first request's seconds to its first token. Its first request
        (riders: all of them) goes first; once it streams, the others at once, or (riders)
        each late prompt alone beside them."""
        started = [asyncio.Event() for _ in range(load.count if load.late else 1)]
        one = partial(self.one, model, load.tokens, load.answer)
        first = [asyncio.create_task(one(event, load.cached_prefix)) for event in started]
        try:
            await asyncio.gather(*(event.wait() for event in started))
            for tokens in load.late:
                await self.one(model, tokens, 2)
            await asyncio.gather(*(one() for _ in range(0 if load.late else load.count - 1)))
        except BaseException:
            await asyncio.gather(*first, return_exceptions=True)  # theirs are not left unread
            raise
        return (await asyncio.gather(*first))[0]
