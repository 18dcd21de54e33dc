"""Which sendpath replicas run where on a Ray cluster, and how loaded each is.

One ``Directory`` per cluster, as a named Ray actor (``open_directory``). Every replica
pushes a ``ReplicaReport`` each ``REPORT_INTERVAL_S``: its URL, the node and host it runs
on, its status and what its ``/load`` says. Gateways long-poll ``watch(version)``, which
answers as soon as anything changed (or after its timeout), with every replica's last
report: their routers are fed by these pushes instead of polling each replica.

A replica that stops cleanly (Serve scaled it down) ``leave``s at once; one whose reports
stop for ``EXPIRE_S`` (its node died, its process was killed) is dropped, so gateways
forget it. Gateways ``queued`` how many requests wait in their admission queue, and a
replica's report returns its share of all of them: its autoscaling stats carry that to
Serve's controller (``autoscale.py``), so the fleet grows on the gateways' queue as well
as on the replicas' own.

The actor holds nothing that cannot be rebuilt: if it restarts, the next round of
reports fills it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIRECTORY_NAME",
    "EXPIRE_S",
    "NAMESPACE",
    "REPORT_INTERVAL_S",
    "Directory",
    "ReplicaReport",
    "Snapshot",
    "open_directory",
]

NAMESPACE = "sendpath"  # the Ray namespace of sendpath's actors and Serve app
DIRECTORY_NAME = "sendpath-directory"
REPORT_INTERVAL_S = 0.5  # a replica's push period
EXPIRE_S = 3.0  # no report for this long: the replica is gone
MAX_ERRORS = 16
MAX_LEFT = 4096
GATEWAY_EXPIRE_S = 5.0  # a gateway's queue that has not been reported for this long is 0


@dataclass(frozen=True)
class ReplicaReport:
    """One replica, as it says itself."""

    replica_id: str  # Serve's replica id: stable while the process lives
    url: str  # where gateways send it requests
    node_id: str  # the Ray node it runs on
    host: str  # that node's host name
    status: str  # the replica's /health status: loading, ok, draining, stuck, failed
    load: dict[str, Any] = field(default_factory=dict)  # its /load (empty until ready)


@dataclass(frozen=True)
class Snapshot:
    """Every replica's last report, at ``version`` (it grows with each change)."""

    version: int
    replicas: tuple[ReplicaReport, ...]


class Directory:
    """The replicas' reports and the gateways' queues (the actor's state)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._replicas: dict[str, tuple[ReplicaReport, float]] = {}
        self._queued: dict[str, tuple[int, float]] = {}  # gateway -> (waiting, when)
        self._left: dict[str, None] = {}  # replicas that left (ids are never reused)
        self.errors: list[str] = []  # why replicas could not start, the latest last
        self.version = 0
        self._changed: asyncio.Event | None = None  # made in the actor's loop

    def report(self, report: ReplicaReport) -> float:
        """A replica's push; returns its share of the requests the gateways have queued.
        A replica that left is not taken back (a report still on its way when it left)."""
        if report.replica_id not in self._left:
            self._replicas[report.replica_id] = (report, self._clock())
            self._bump()
        return self.queued_total() / max(1, len(self._replicas))

    def leave(self, replica_id: str) -> None:
        """A replica stops: gateways send it nothing more."""
        self._left[replica_id] = None
        while len(self._left) > MAX_LEFT:
            del self._left[next(iter(self._left))]
        if self._replicas.pop(replica_id, None) is not None:
            self._bump()

    def failed(self, message: str) -> None:
        """A replica could not start (what `serve` shows while it waits)."""
        self.errors = [*self.errors[-(MAX_ERRORS - 1) :], message]

    def last_error(self) -> str | None:
        return self.errors[-1] if self.errors else None

    def queued(self, gateway_id: str, waiting: int) -> None:
        """A gateway's admission queue holds ``waiting`` requests."""
        self._queued[gateway_id] = (max(0, int(waiting)), self._clock())

    def queued_total(self) -> int:
        now = self._clock()
        return sum(n for n, at in self._queued.values() if now - at <= GATEWAY_EXPIRE_S)

    def snapshot(self) -> Snapshot:
        """The replicas that reported within ``EXPIRE_S`` (the others are dropped)."""
        now = self._clock()
        expired = [k for k, (_, at) in self._replicas.items() if now - at > EXPIRE_S]
        for key in expired:
            del self._replicas[key]
        if expired:
            self.version += 1
        return Snapshot(self.version, tuple(r for r, _ in self._replicas.values()))

    async def watch(self, version: int, timeout_s: float) -> Snapshot:
        """The snapshot once it is newer than ``version``, or after ``timeout_s``."""
        if self._changed is None:
            self._changed = asyncio.Event()
        if self.version <= version:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.snapshot()

    def _bump(self) -> None:
        self.version += 1
        if self._changed is not None:
            self._changed.set()


def open_directory() -> Any:
    """The cluster's directory actor (made by the first caller; needs ``ray.init``). It is
    detached, so gateways and replicas keep it while any of them lives, and restarted by
    Ray if its process dies."""
    import ray

    actor: Any = (
        ray.remote(Directory)
        .options(
            name=DIRECTORY_NAME,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=-1,
        )
        .remote()
    )
    return actor
