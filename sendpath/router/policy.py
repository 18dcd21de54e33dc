"""Routing policies: which of the candidate replicas gets a request.

A policy sees the request as a ``RouteRequest`` (its prompt text, approximately as the
replica will see it, its prefix-cache salt, and its token ids when the gateway asked a
replica for them) and the candidates (healthy, with room),
and picks one. ``routed`` tells it where the request went, so a policy that learns (the
prefix tree) can remember. Policies are plain objects with no I/O and no clock of their
own, so the simulator runs the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sendpath.api.prompt import route_text
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.kvcache.hashing import BlockHash, block_hashes
from sendpath.router.pool import Endpoint

if TYPE_CHECKING:
    from sendpath.router.kv_index import KVIndex

__all__ = [
    "POLICIES",
    "LeastLoad",
    "Prediction",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]


@dataclass(frozen=True)
class RouteRequest:
    text: str  # the prompt: chat messages as "role\ncontent\n", or the completion prompt
    salt: str | None = None  # the prefix-cache salt the replica gets (per-key isolation)
    chat: bool = True
    token_ids: tuple[int, ...] | None = None  # as the replica tokenizes it, if known
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, compare=False, repr=False)

    def token_hashes(self, block_size: int) -> list[BlockHash]:
        """The chained hashes of the prompt's blocks a replica could serve from cache (its
        full blocks before the last token), as the replica computes them; ``[]`` without
        token ids."""
        found = self._hashes.get(block_size)
        if found is None:
            ids = self.token_ids or ()
            found = self._hashes[block_size] = block_hashes(ids[:-1], block_size, self.salt)
        return found

    def answered(self, answer: str) -> RouteRequest:
        """The prompt followed by its answer: how the conversation's next turn starts."""
        suffix = f"assistant\n{answer}\n" if self.chat else answer
        return RouteRequest(self.text + suffix, self.salt, self.chat)


def route_request(request: ChatBody | CompletionBody, salt: str | None) -> RouteRequest:
    """The routing view of a checked OpenAI request (``api.prompt.route_text``)."""
    return RouteRequest(route_text(request), salt, chat=isinstance(request, ChatBody))


@dataclass(frozen=True)
class Prediction:
    """What a policy expected of the replica it chose: how much of the prompt it holds
    (``precise``: from that replica's KV events, in its token blocks of ``block_size``;
    else the gateway's guess, in blocks of text)."""

    matched_blocks: int
    prompt_blocks: int
    precise: bool
    block_size: int | None = None  # tokens per block (precise only)

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens expected to come from the replica's cache (precise only)."""
        return self.matched_blocks * self.block_size if self.block_size else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "match": "precise" if self.precise else "approximate",
            "matched_blocks": self.matched_blocks,
            "prompt_blocks": self.prompt_blocks,
            "predicted_cached_tokens": self.cached_tokens,
        }


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


def _prefix_aware(index: KVIndex | None) -> RoutingPolicy:
    from sendpath.router.prefix_aware import PrefixAware

    return PrefixAware(index)


# Each makes a policy given the index of what replicas hold (from their KV events; None
# when the gateway follows none), which only the prefix-aware policy reads.
POLICIES: dict[str, Callable[[KVIndex | None], RoutingPolicy]] = {
    "round_robin": lambda index: RoundRobin(),
    "least_load": lambda index: LeastLoad(),
    "prefix_aware": _prefix_aware,
}


def make_policy(name: str, index: KVIndex | None = None) -> RoutingPolicy:
    """A new policy by its registry name."""
    try:
        return POLICIES[name](index)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}"
        ) from None
