"""The router: a policy choosing among the pool's healthy replicas, and the health checks.

``choose`` asks the policy among the replicas that are healthy, have room and were not
already tried for this request; ``failed``/``succeeded`` feed passive health; ``check``
runs one round of active checks (``run_checks`` loops it). ``on_change`` is called when
the set of healthy replicas changes, so admission can resize to the fleet. After each
round, ``on_checked`` sees the pool (the KV event subscriber follows the replicas that
announce events there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from sendpath.router.policy import RoutingPolicy
from sendpath.router.pool import (
    CHECK_INTERVAL_S,
    CHECK_TIMEOUT_S,
    Endpoint,
    EventSource,
    ReplicaPool,
)
from sendpath.router.route import Prediction, RouteRequest

__all__ = ["Router"]

logger = logging.getLogger("sendpath.router")


class Router:
    """Routing decisions and health for one gateway process."""

    def __init__(
        self,
        pool: ReplicaPool,
        policy: RoutingPolicy,
        on_change: Callable[[], None] = lambda: None,
        on_checked: Callable[[ReplicaPool], None] = lambda pool: None,
    ) -> None:
        self.pool, self.policy, self.on_change = pool, policy, on_change
        self.on_checked = on_checked
        self._no_load: set[int] = set()  # replicas without a /load endpoint (not ours)
        self._no_ready: set[int] = set()  # without /ready (not ours): /health says ready

    def choose(self, request: RouteRequest, exclude: set[int] | None = None) -> Endpoint | None:
        """The replica for ``request`` (``None``: no healthy replica with room)."""
        chosen = self.route(request, exclude)
        return chosen[0] if chosen is not None else None

    def route(
        self, request: RouteRequest, exclude: set[int] | None = None
    ) -> tuple[Endpoint, Prediction | None] | None:
        """The replica for ``request`` and what the policy expected of it (how much of the
        prompt it holds, before this request adds its own guess); ``None``: no healthy
        replica with room."""
        candidates = self.pool.candidates(exclude)
        if not candidates:
            return None
        endpoint = self.policy.choose(request, candidates)
        prediction = self.policy.predicted(request, endpoint)
        self.policy.routed(request, endpoint)
        return endpoint, prediction

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
        """One round of active health checks, all polled replicas at once (a replica that
        pushes its load is ``reported`` instead)."""
        polled = [e for e in self.pool.endpoints if not e.reported]
        before = [e.healthy for e in polled]
        await asyncio.gather(*(self._check(client, e) for e in polled))
        self.on_checked(self.pool)
        changed = False
        for e, was in zip(polled, before, strict=True):
            if was != e.healthy:
                state = "back in service" if e.healthy else "out of service"
                logger.warning("replica %s %s", e.url, state)
                changed = True
        if changed:
            self.on_change()

    def joined(self, endpoint: Endpoint) -> None:
        """A replica was added to the pool (a cluster engine placed it)."""
        logger.info("replica %s (%s) joined", endpoint.name, endpoint.url)
        self.on_checked(self.pool)
        self.on_change()

    def left(self, endpoint: Endpoint) -> None:
        """A replica was removed from the pool: what the policy learned of it is dropped."""
        logger.warning("replica %s (%s) left", endpoint.name, endpoint.url)
        self.policy.forget(endpoint)
        self.on_checked(self.pool)
        self.on_change()

    def reported(self, endpoint: Endpoint, report: dict[str, Any]) -> None:
        """A pushed load report (what ``/load`` says, plus ``status``): the active check's
        result, without the round trip."""
        was = endpoint.healthy
        status = report.get("status")
        ok = status == "ok"
        stats = {k: float(v) for k, v in report.items() if isinstance(v, int | float)}
        load = None
        if "num_requests_running" in stats and "num_requests_waiting" in stats:
            load = int(stats["num_requests_running"] + stats["num_requests_waiting"])
        events = event_source(report.get("kv_events"), endpoint.url)
        self.pool.checked(endpoint, ok, load, stats or None, status == "stuck", events)
        if was != endpoint.healthy:
            state = "back in service" if endpoint.healthy else "out of service"
            logger.warning("replica %s %s (%s)", endpoint.url, state, status)
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
            load, stats, events = None, None, None
            if ok and endpoint.index not in self._no_load:
                lr = await client.get(endpoint.url + "/load", timeout=CHECK_TIMEOUT_S)
                if lr.status_code == 200:
                    raw = lr.json()
                    stats = {k: float(v) for k, v in raw.items() if isinstance(v, int | float)}
                    load = int(raw["num_requests_running"]) + int(raw["num_requests_waiting"])
                    events = event_source(raw.get("kv_events"), endpoint.url)
                elif lr.status_code == 404:
                    self._no_load.add(endpoint.index)  # e.g. vLLM: in-flight counts only
        except (httpx.HTTPError, ValueError, KeyError):
            ok, load, stats, stuck, events = False, None, None, False, None
        self.pool.checked(endpoint, ok, load, stats, stuck, events)

    async def run_checks(
        self, client: httpx.AsyncClient, interval: float = CHECK_INTERVAL_S
    ) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await self.check(client)
            await asyncio.sleep(interval)


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def event_source(raw: Any, replica_url: str) -> EventSource | None:
    """Where a replica's ``/load`` says it publishes KV events (``None``: nowhere, or not
    a TCP or IPC address a gateway could reach). A wildcard host means the replica's."""
    if not isinstance(raw, dict):
        return None
    endpoint, replay = raw.get("endpoint"), raw.get("replay_endpoint")
    topic, size = raw.get("topic", ""), raw.get("block_size")
    if not isinstance(endpoint, str) or not isinstance(topic, str):
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return None
    host = urlsplit(replica_url).hostname or "127.0.0.1"

    def reachable(address: str) -> str | None:
        if address.startswith("ipc://"):
            return address
        if not address.startswith("tcp://"):
            return None
        where, _, port = address.removeprefix("tcp://").rpartition(":")
        if not port.isdigit():
            return None
        if where in WILDCARD_HOSTS:
            where = f"[{host}]" if ":" in host else host
        return f"tcp://{where}:{port}"

    pub = reachable(endpoint)
    if pub is None:
        return None
    again = reachable(replay) if isinstance(replay, str) else None
    return EventSource(pub, again, topic, size)


def _status(r: httpx.Response) -> str | None:
    """The ``status`` a health answer gives, if it is our JSON."""
    try:
        body = r.json()
    except ValueError:
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None
