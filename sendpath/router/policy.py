"""Routing policies: which of the candidate replicas gets a request.

A policy sees the request as a ``RouteRequest`` (``route.py``: its prompt text,
approximately as the replica will see it, its prefix-cache salt, and its token ids when
the gateway asked a replica for them) and the candidates (healthy, with room), and picks
one; ``predicted`` says what it expected of the one it picked. ``routed`` tells it where
the request went, so a policy that learns (the prefix tree) can remember. Policies are
plain objects with no I/O and no clock of their own, so the simulator runs the same ones.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from sendpath.router.pool import Endpoint
from sendpath.router.prefix_aware import PrefixAware
from sendpath.router.route import Prediction, RouteRequest

if TYPE_CHECKING:
    from sendpath.router.kv_index import KVIndex

__all__ = ["POLICIES", "LeastLoad", "RoundRobin", "RoutingPolicy", "make_policy"]


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        """One of ``candidates`` (never empty)."""
        ...

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        """The request was sent to ``endpoint``."""
        ...

    def forget(self, endpoint: Endpoint) -> None:
        """``endpoint`` was ejected: whatever was learned about its cache may be gone."""
        ...

    def predicted(self, request: RouteRequest, endpoint: Endpoint) -> Prediction | None:
        """What choosing ``endpoint`` for ``request`` expects (``None``: nothing, the
        policy does not look at caches)."""
        ...


_INDEX = attrgetter("index")


class RoundRobin:
    """Each replica in turn, skipping those that cannot take the request."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last = -1

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        # the first after the last one chosen (candidates come in index order), found by
        # bisection: a fleet of 128 is not scanned from its start for every request
        after = bisect.bisect_right(candidates, self._last, key=_INDEX)
        chosen = candidates[after] if after < len(candidates) else candidates[0]
        self._last = chosen.index
        return chosen

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        pass

    def forget(self, endpoint: Endpoint) -> None:
        pass

    def predicted(self, request: RouteRequest, endpoint: Endpoint) -> Prediction | None:
        return None


class LeastLoad:
    """The replica with the fewest requests (``Endpoint.load``: this gateway's in flight
    plus what the replica last reported beyond them). Ties go round-robin."""

    name = "least_load"

    def __init__(self) -> None:
        self._tie = RoundRobin()

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        least = min(e.load for e in candidates)
        return self._tie.choose(request, [e for e in candidates if e.load == least])

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        pass

    def forget(self, endpoint: Endpoint) -> None:
        pass

    def predicted(self, request: RouteRequest, endpoint: Endpoint) -> Prediction | None:
        return None


# Each makes a policy given the index of what replicas hold (from their KV events; None
# when the gateway follows none), which only the prefix-aware policy reads.
POLICIES: dict[str, Callable[[KVIndex | None], RoutingPolicy]] = {
    "round_robin": lambda index: RoundRobin(),
    "least_load": lambda index: LeastLoad(),
    "prefix_aware": PrefixAware,
}


def make_policy(name: str, index: KVIndex | None = None) -> RoutingPolicy:
    """A new policy by its registry name."""
    try:
        return POLICIES[name](index)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}"
        ) from None
