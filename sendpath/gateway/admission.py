"""Admission: a bound on requests in flight, and a queue that is fair across keys.

At most ``capacity`` requests are forwarded at once (the fleet's in-flight bound: the
per-replica bound times the replicas). A request that finds the fleet full waits in its
key's line; when a slot frees, the lines are served round-robin, one request per key in
turn, so a key with a thousand queued requests cannot starve a key with one. A request
that waits longer than ``timeout_s`` gets 503 with Retry-After, and one that finds
``max_waiting`` requests already waiting is refused at once with the same answer.
Cancellation (the client left while queued) removes the waiter and loses no slot.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from sendpath.errors import ServiceUnavailableError

__all__ = ["AdmissionQueue"]


class AdmissionQueue:
    """Slots for requests in flight, and per-key lines served round-robin (one event loop)."""

    def __init__(self, capacity: int, max_waiting: int, timeout_s: float) -> None:
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.num_in_flight = 0
        self.num_waiting = 0
        self._lines: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    async def acquire(self, key: str) -> None:
        """Take a slot, waiting in ``key``'s line if none is free; raises
        ``ServiceUnavailableError`` when the queue is full or the wait times out."""
        if self.num_in_flight < self.capacity and not self._lines:
            self.num_in_flight += 1
            return
        if self.num_waiting >= self.max_waiting:
            raise ServiceUnavailableError(
                f"The gateway is at capacity: {self.num_in_flight} requests in flight and "
                f"{self.num_waiting} waiting. Retry after the Retry-After header's seconds."
            )
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lines.setdefault(key, deque()).append(granted)
        self.num_waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.timeout_s)
        except TimeoutError:
            if granted.done():  # granted in the same instant the wait ran out: keep it
                return
            self._remove(key, granted)
            raise ServiceUnavailableError(
                f"The request waited {self.timeout_s:g} s for a free slot and timed out; the "
                "fleet is overloaded. Retry after the Retry-After header's seconds."
            ) from None
        except asyncio.CancelledError:
            if granted.done():
                self.release()
            else:
                self._remove(key, granted)
            raise

    def release(self) -> None:
        """Give a slot back and hand it to the next line in turn."""
        self.num_in_flight -= 1
        self.grant()

    def resize(self, capacity: int) -> None:
        """A new in-flight bound (replicas came or went); waiters get any new slots."""
        self.capacity = capacity
        self.grant()

    def grant(self) -> None:
        while self.num_in_flight < self.capacity and self._lines:
            key, line = self._lines.popitem(last=False)
            granted = line.popleft()
            if line:
                self._lines[key] = line  # to the back: the next key goes first
            self.num_waiting -= 1
            self.num_in_flight += 1
            granted.set_result(None)

    def _remove(self, key: str, granted: asyncio.Future[None]) -> None:
        line = self._lines.get(key)
        if line is not None and granted in line:
            line.remove(granted)
            self.num_waiting -= 1
            if not line:
                del self._lines[key]
