"""A gateway's view of the cluster's replicas: the pool follows the directory.

``DirectoryFollower.run`` long-polls the directory (``directory.py``) and makes the pool
match it: a replica that appears is added (as ``reported``: its load comes with the
directory's answers, so the router's active check leaves it alone), one that disappeared
is removed and forgotten by the router, and every report updates its endpoint's health
and load. After each answer the gateway says how many requests wait in its queue.

The directory is reached through ``DirectoryClient`` (a Ray actor handle's calls, each
awaited); tests hand in the ``Directory`` itself.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from sendpath.cluster.directory import Directory, ReplicaReport, Snapshot
from sendpath.gateway.admission import AdmissionQueue
from sendpath.router.pool import Endpoint
from sendpath.router.router import Router

__all__ = [
    "ActorDirectory",
    "DirectoryClient",
    "DirectoryFollower",
    "LocalDirectory",
    "ray_members",
]

logger = logging.getLogger("sendpath.cluster")

WATCH_TIMEOUT_S = 1.0  # the directory answers at least this often (the queue report's period)
RETRY_S = 1.0  # after a failed call (the directory restarting)
FIRST_TIMEOUT_S = 10.0  # the gateway's start waits this long at most for the first answer


class DirectoryClient(Protocol):
    async def watch(self, version: int, timeout_s: float) -> Snapshot: ...

    async def queued(self, gateway_id: str, waiting: int) -> None: ...


class ActorDirectory:
    """The directory actor's calls, awaited."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def watch(self, version: int, timeout_s: float) -> Snapshot:
        found: Snapshot = await self.actor.watch.remote(version, timeout_s)
        return found

    async def queued(self, gateway_id: str, waiting: int) -> None:
        await self.actor.queued.remote(gateway_id, waiting)


class LocalDirectory:
    """A ``Directory`` in this process (tests)."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    async def watch(self, version: int, timeout_s: float) -> Snapshot:
        return await self.directory.watch(version, timeout_s)

    async def queued(self, gateway_id: str, waiting: int) -> None:
        self.directory.queued(gateway_id, waiting)


class DirectoryFollower:
    """Keeps ``router.pool`` equal to the directory's replicas."""

    def __init__(
        self,
        directory: DirectoryClient,
        router: Router,
        api_key: str | None,
        waiting: Callable[[], int],
    ) -> None:
        self.directory, self.router, self.api_key = directory, router, api_key
        self.waiting = waiting  # requests in this gateway's admission queue
        self.gateway_id = uuid.uuid4().hex
        self.members: dict[str, Endpoint] = {}  # Serve replica id -> its endpoint
        self.version = -1

    async def first(self, timeout_s: float = FIRST_TIMEOUT_S) -> None:
        """Take the directory's replicas once, before the gateway listens: a request sent
        the moment it says it listens finds the replicas the start waited for. A directory
        that does not answer in ``timeout_s`` is left to ``run`` (warned here)."""
        try:
            snapshot = await asyncio.wait_for(self.directory.watch(self.version, 0), timeout_s)
        except Exception as exc:  # the actor restarting: run() retries
            logger.warning("the replica directory did not answer at start (%r)", exc)
            return
        self.apply(snapshot)

    async def run(self) -> None:
        """Follow until cancelled."""
        while True:
            try:
                snapshot = await self.directory.watch(self.version, WATCH_TIMEOUT_S)
                self.apply(snapshot)
                await self.directory.queued(self.gateway_id, self.waiting())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor restarting, the cluster going away
                logger.warning("the replica directory did not answer (%s); retrying", exc)
                await asyncio.sleep(RETRY_S)

    def apply(self, snapshot: Snapshot) -> None:
        """Add, update and remove endpoints to match ``snapshot``."""
        self.version = snapshot.version
        present = {r.replica_id: r for r in snapshot.replicas}
        for replica_id in [k for k in self.members if k not in present]:
            self.router.pool.remove(endpoint := self.members.pop(replica_id))
            self.router.left(endpoint)
        for replica_id, report in present.items():
            known = self.members.get(replica_id)
            if known is not None and known.url != report.url.rstrip("/"):
                self.router.pool.remove(known)  # restarted on a new port: a new replica
                self.router.left(known)
                known = None
            if known is not None:
                self._report(known, report)
                continue
            endpoint = self.router.pool.add(report.url, self.api_key, reported=True)
            endpoint.where = where(report)
            self.members[replica_id] = endpoint
            self._report(endpoint, report)
            self.router.joined(endpoint)

    def _report(self, endpoint: Endpoint, report: ReplicaReport) -> None:
        self.router.reported(endpoint, {**report.load, "status": report.status})


def where(report: ReplicaReport) -> dict[str, str]:
    """What ``/fleet`` shows of where a replica runs."""
    return {"engine": "ray", "node": report.node_id, "host": report.host, "id": report.replica_id}


def ray_members(
    address: str, api_key: str | None
) -> Callable[[Router, AdmissionQueue], DirectoryFollower]:
    """What follows the sendpath replicas of the Ray cluster at ``address`` (joined now)."""
    from sendpath.cluster.directory import open_directory
    from sendpath.cluster.fleet import connect

    logger.debug("%s", connect(address))
    actor = ActorDirectory(open_directory())

    def follow(router: Router, queue: AdmissionQueue) -> DirectoryFollower:
        return DirectoryFollower(actor, router, api_key, lambda: queue.num_waiting)

    return follow
