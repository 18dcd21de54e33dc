"""The replicas behind the gateway and what the gateway knows of each.

An ``Endpoint`` is one OpenAI-compatible server (ours, vLLM, llama.cpp): its URL, how many
requests the gateway has in flight there and may have at most, and whether it is in
service. The pool hands out only endpoints that are in service and below their bound.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Endpoint", "ReplicaPool"]


@dataclass
class Endpoint:
    """One replica, as the gateway sees it."""

    url: str
    max_in_flight: int
    in_flight: int = 0
    healthy: bool = True

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.max_in_flight


class ReplicaPool:
    """The fleet: endpoints in a fixed order (their index is their identity)."""

    def __init__(self, urls: list[str] | tuple[str, ...], max_in_flight: int) -> None:
        if not urls:
            raise ValueError("the gateway needs at least one replica URL (--replica URL)")
        self.endpoints = [Endpoint(url.rstrip("/"), max_in_flight) for url in urls]

    @property
    def capacity(self) -> int:
        """Requests the healthy endpoints can take at once (the admission bound)."""
        return sum(e.max_in_flight for e in self.endpoints if e.healthy)

    def candidates(self) -> list[Endpoint]:
        """Endpoints that can take one more request now."""
        return [e for e in self.endpoints if e.has_room]
