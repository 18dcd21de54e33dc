"""The router: a policy choosing among the pool's healthy replicas, and the health checks.

``choose`` asks the policy among the replicas that are healthy, have room and were not
already tried for this request; ``failed``/``succeeded`` feed passive health; ``check``
runs one round of active checks (``run_checks`` loops it). ``on_change`` is called when
the set of healthy replicas changes, so admission can resize to the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from sendpath.router.policy import RouteRequest, RoutingPolicy
from sendpath.router.pool import CHECK_INTERVAL_S, CHECK_TIMEOUT_S, Endpoint, ReplicaPool

__all__ = ["Router"]

logger = logging.getLogger("sendpath.router")


class Router:
    """Routing decisions and health for one gateway process."""

    def __init__(
        self,
        pool: ReplicaPool,
        policy: RoutingPolicy,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.pool, self.policy, self.on_change = pool, policy, on_change
        self._no_load: set[int] = set()  # replicas without a /load endpoint (not ours)
        self._no_ready: set[int] = set()  # without /ready (not ours): /health says ready

    def choose(self, request: RouteRequest, exclude: set[int] | None = None) -> Endpoint | None:
        """The replica for ``request`` (``None``: no healthy replica with room)."""
        candidates = self.pool.candidates(exclude)
        if not candidates:
            return None
        endpoint = self.policy.choose(request, candidates)
        self.policy.routed(request, endpoint)
        return endpoint

    def answered(self, request: RouteRequest, endpoint: Endpoint, answer: str) -> None:
        """``endpoint`` answered ``request`` with ``answer`` (now in its prefix cache too)."""
        if answer:
            self.policy.routed(request.answered(answer), endpoint)

    def failed(self, endpoint: Endpoint, why: str) -> None:
        if self.pool.failed(endpoint):
            logger.warning("replica %s ejected (%s)", endpoint.url, why)
            self.policy.forget(endpoint)
            self.on_change()

    def succeeded(self, endpoint: Endpoint) -> None:
        self.pool.succeeded(endpoint)

    async def check(self, client: httpx.AsyncClient) -> None:
        """One round of active health checks, all replicas at once."""
        before = [e.healthy for e in self.pool.endpoints]
        await asyncio.gather(*(self._check(client, e) for e in self.pool.endpoints))
        after = [e.healthy for e in self.pool.endpoints]
        if before != after:
            for e, was in zip(self.pool.endpoints, before, strict=True):
                if was != e.healthy:
                    state = "back in service" if e.healthy else "out of service"
                    logger.warning("replica %s %s", e.url, state)
            self.on_change()

    async def _check(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        try:
            path = "/health" if endpoint.index in self._no_ready else "/ready"
            r = await client.get(endpoint.url + path, timeout=CHECK_TIMEOUT_S)
            if r.status_code == 404 and path == "/ready":
                self._no_ready.add(endpoint.index)
                r = await client.get(endpoint.url + "/health", timeout=CHECK_TIMEOUT_S)
            ok = r.status_code == 200
            stuck = not ok and _status(r) == "stuck"
            load, stats = None, None
            if ok and endpoint.index not in self._no_load:
                lr = await client.get(endpoint.url + "/load", timeout=CHECK_TIMEOUT_S)
                if lr.status_code == 200:
                    raw = lr.json()
                    stats = {k: float(v) for k, v in raw.items() if isinstance(v, int | float)}
                    load = int(raw["num_requests_running"]) + int(raw["num_requests_waiting"])
                elif lr.status_code == 404:
                    self._no_load.add(endpoint.index)  # e.g. vLLM: in-flight counts only
        except (httpx.HTTPError, ValueError, KeyError):
            ok, load, stats, stuck = False, None, None, False
        self.pool.checked(endpoint, ok, load, stats, stuck)

    async def run_checks(
        self, client: httpx.AsyncClient, interval: float = CHECK_INTERVAL_S
    ) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await self.check(client)
            await asyncio.sleep(interval)


def _status(r: httpx.Response) -> str | None:
    """The ``status`` a health answer gives, if it is our JSON."""
    try:
        body = r.json()
    except ValueError:
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None
