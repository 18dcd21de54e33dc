"""Routing policies: which of the candidate replicas gets a request.

A policy sees the request as a ``RouteRequest`` (its prompt text, approximately as the
replica will see it, and its prefix-cache salt) and the candidates (healthy, with room),
and picks one. ``routed`` tells it where the request went, so a policy that learns (the
prefix tree) can remember. Policies are plain objects with no I/O and no clock of their
own, so the simulator runs the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sendpath.api.prompt import route_text
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.router.pool import Endpoint

__all__ = ["POLICIES", "LeastLoad", "RoundRobin", "RouteRequest", "RoutingPolicy", "make_policy"]


@dataclass(frozen=True)
class RouteRequest:
    text: str  # the prompt: chat messages as "role\ncontent\n", or the completion prompt
    salt: str | None = None  # the tenant's prefix-cache salt (per-key isolation)
    chat: bool = True

    def answered(self, answer: str) -> RouteRequest:
        """The prompt followed by its answer: how the conversation's next turn starts."""
        suffix = f"assistant\n{answer}\n" if self.chat else answer
        return RouteRequest(self.text + suffix, self.salt, self.chat)


def route_request(request: ChatBody | CompletionBody, salt: str | None) -> RouteRequest:
    """The routing view of a checked OpenAI request (``api.prompt.route_text``)."""
    return RouteRequest(route_text(request), salt, chat=isinstance(request, ChatBody))


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


class RoundRobin:
    """Each replica in turn, skipping those that cannot take the request."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last = -1

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        # the first after the last one chosen (candidates come in index order): stops
        # there, not a pass over every replica per request
        chosen = next((e for e in candidates if e.index > self._last), candidates[0])
        self._last = chosen.index
        return chosen

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        pass

    def forget(self, endpoint: Endpoint) -> None:
        pass


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


def _prefix_aware() -> RoutingPolicy:
    from sendpath.router.prefix_aware import PrefixAware

    return PrefixAware()


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "prefix_aware": _prefix_aware,
}


def make_policy(name: str) -> RoutingPolicy:
    """A new policy by its registry name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}"
        ) from None
