"""Waiting-queue policies: who is admitted next, and who is preempted first.

``fcfs``: the order requests join the queue (on a server: once tokenized, which runs in
parallel, so a short prompt may overtake a long one sent just before it); preempted
requests go back to the front. ``priority``: lowest ``priority`` value first, then
arrival. In both, the preemption victim is the request the policy would admit last
(newest, or lowest priority then newest).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from sendpath.request import Request

__all__ = ["FCFSQueue", "PriorityQueue", "WaitingQueue", "make_queue"]


class WaitingQueue(Protocol):
    """The waiting requests in admission order."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...  # a preempted request
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...

    @staticmethod
    def victim_key(request: Request) -> tuple[float, ...]:
        """Larger key = preempted first."""
        ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    @staticmethod
    def victim_key(request: Request) -> tuple[float, ...]:
        return (request.arrival_time,)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        item = (request.priority, request.arrival_time, next(self._seq), request)
        heapq.heappush(self._heap, item)

    prepend = add  # the heap order already puts an earlier arrival first

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap))

    @staticmethod
    def victim_key(request: Request) -> tuple[float, ...]:
        return (request.priority, request.arrival_time)


QUEUES: dict[str, type[FCFSQueue] | type[PriorityQueue]] = {
    "fcfs": FCFSQueue,
    "priority": PriorityQueue,
}


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue for a policy name (see ``QUEUES``)."""
    return QUEUES[policy]()
