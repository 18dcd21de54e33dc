"""The replicas behind the gateway and what the gateway knows of each: load and health.

An ``Endpoint`` is one OpenAI-compatible server (ours, vLLM, llama.cpp): its URL, how many
requests the gateway has in flight there (and may have at most), the load it last
reported, and whether it is in service.

Clients see a replica only by its ``name`` (``replica-0``, ...), never its URL.

Health, with every tunable here:
- Active: every ``CHECK_INTERVAL_S`` the gateway asks each replica's ``/ready`` (or its
  ``/health``, for a server without ``/ready``, such as vLLM) and ``/load``, if it has one.
  A failed check takes the replica out of service; a passing one puts it back, unless it
  is ejected and its backoff has not run out. Both answer at once on our replicas (from
  the engine's last snapshot), so a long prompt step does not make a replica look dead.
- Passive: a request that cannot reach a replica, or gets a 5xx that is not "busy", is a
  failure. ``EJECT_AFTER`` consecutive failures eject the replica for a backoff that
  starts at ``BACKOFF_S`` and doubles on each ejection in a row up to ``MAX_BACKOFF_S``;
  after it, the next passing check readmits it. A success resets the count.
- Busy is not broken: a 429, or a 503 whose code is ``queue_full``, only sends the request
  elsewhere; it never counts towards ejection.
- Reported: a replica placed by a cluster engine (``sendpath.cluster``) pushes its load
  and readiness instead (``Endpoint.reported``); the active check leaves it alone.

Membership is fixed for ``--replica`` URLs and `serve`'s local processes; a cluster
engine ``add``s and ``remove``s replicas as they come and go. An index is never reused,
so what was learned about a replica that left cannot be mistaken for a newcomer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sendpath.clock import Clock

__all__ = ["Endpoint", "EventSource", "ReplicaPool"]

CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 2.0
EJECT_AFTER = 2
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class EventSource:
    """Where a replica publishes its KV events, as its ``/load`` says (addresses a gateway
    connects to: a wildcard host is the replica's own)."""

    endpoint: str  # ZMQ PUB
    replay_endpoint: str | None  # ZMQ ROUTER for missed batches
    topic: str
    block_size: int


@dataclass
class Endpoint:
    """One replica, as the gateway sees it."""

    index: int
    url: str  # internal: in logs and operator views, never in answers to clients
    max_in_flight: int
    api_key: str | None = None  # sent to it as a bearer token (its --api-key)
    in_flight: int = 0
    up: bool = True  # the last active check passed (optimistic until the first one)
    ejected_until: float | None = None  # set while ejected by passive failures
    failures: int = 0  # consecutive request failures
    ejections: int = 0  # ejections in a row (the backoff's exponent)
    external_load: int = 0  # running + waiting at the replica that are not this gateway's
    stuck: bool = False  # its last check said an engine step has run too long
    stats: dict[str, float] = field(default_factory=dict)  # its last /load, as it said it
    events: EventSource | None = None  # where it publishes KV events (None: it does not)
    reported: bool = False  # it pushes its load (a cluster engine's replica): not polled
    where: dict[str, str] = field(default_factory=dict)  # where it runs (node, host), if known

    @property
    def name(self) -> str:
        """What clients see of this replica."""
        return f"replica-{self.index}"

    @property
    def headers(self) -> dict[str, str]:
        """What every request to it carries: its key, if it has one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def healthy(self) -> bool:
        return self.up and self.ejected_until is None

    @property
    def load(self) -> int:
        """Requests this replica is busy with: this gateway's own (exact) plus the others
        it reported at the last check (other gateways' or direct clients')."""
        return self.in_flight + self.external_load

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.max_in_flight


class ReplicaPool:
    """The fleet: endpoints in a fixed order (their index is their identity)."""

    def __init__(
        self,
        urls: list[str] | tuple[str, ...],
        max_in_flight: int,
        clock: Clock,
        api_keys: Sequence[str | None] = (),
        dynamic: bool = False,
    ):
        """``api_keys``: each replica's key, in the order of ``urls`` (none if left out);
        ``dynamic``: replicas join later (``add``), so none at the start is fine."""
        if not urls and not dynamic:
            raise ValueError("the gateway needs at least one replica URL (--replica URL)")
        if len(api_keys) > len(urls):
            raise ValueError("more replica keys than replicas")
        self.clock = clock
        keys = [*api_keys, *([None] * (len(urls) - len(api_keys)))]
        self.max_in_flight = max_in_flight
        self.endpoints = [
            Endpoint(i, url.rstrip("/"), max_in_flight, key)
            for i, (url, key) in enumerate(zip(urls, keys, strict=True))
        ]
        self._next_index = len(self.endpoints)

    def add(self, url: str, api_key: str | None = None, reported: bool = False) -> Endpoint:
        """A replica joined: its endpoint, under an index never used before."""
        endpoint = Endpoint(self._next_index, url.rstrip("/"), self.max_in_flight, api_key)
        endpoint.reported = reported
        self._next_index += 1
        self.endpoints.append(endpoint)
        return endpoint

    def remove(self, endpoint: Endpoint) -> None:
        """A replica left: no new request goes there (those in flight finish or fail)."""
        self.endpoints = [e for e in self.endpoints if e is not endpoint]

    def by_url(self, url: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.url == url), None)

    @property
    def capacity(self) -> int:
        """Requests the healthy endpoints can take at once (the admission bound)."""
        return sum(e.max_in_flight for e in self.endpoints if e.healthy)

    def candidates(self, exclude: set[int] | None = None) -> list[Endpoint]:
        """Endpoints that can take one more request now (``exclude``: already tried)."""
        return [e for e in self.endpoints if e.has_room and e.index not in (exclude or ())]

    def failed(self, endpoint: Endpoint) -> bool:
        """A request failed there; returns True if that ejected the endpoint."""
        endpoint.failures += 1
        if endpoint.failures < EJECT_AFTER or endpoint.ejected_until is not None:
            return False
        backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2**endpoint.ejections)
        endpoint.ejected_until = self.clock.now() + backoff
        endpoint.ejections += 1
        return True

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.failures = 0
        if endpoint.ejected_until is None:
            endpoint.ejections = 0

    def checked(
        self,
        endpoint: Endpoint,
        ok: bool,
        load: int | None = None,
        stats: dict[str, float] | None = None,
        stuck: bool = False,
        events: EventSource | None = None,
    ) -> None:
        """The result of an active health check (``stats``: the replica's /load; ``stuck``:
        it said an engine step is stuck, so what waits on it there will not be answered;
        ``events``: where its /load says it publishes KV events)."""
        endpoint.up, endpoint.stuck = ok, stuck
        if ok and stats is not None:
            endpoint.events = events
        if load is not None:
            endpoint.external_load = max(0, load - endpoint.in_flight)
        if stats is not None:
            endpoint.stats = stats
        if not ok:
            return
        if endpoint.ejected_until is not None and self.clock.now() >= endpoint.ejected_until:
            endpoint.ejected_until = None  # readmitted; ``ejections`` resets on a success
            endpoint.failures = 0
