"""The gateway follows its replicas' KV events, so its router knows what each one holds.

After every round of health checks the router hands the pool to ``KVEventFollower.sync``:
each replica whose ``/load`` announces an event source (``router.pool.EventSource``) gets
one task here, which subscribes to its PUB socket and applies every batch to the router's
``KVIndex`` in sequence order. A replica that stops announcing (or is removed) is
forgotten; one that announces a different source (it restarted on other ports) is
followed afresh.

Sequence numbers keep the index exact (the publisher: ``server/kv_events.py``):
- On subscribing, everything the replica still keeps is asked for from its replay socket
  (from sequence 0), so a gateway that starts late knows what was cached before it came.
- A gap (a batch the SUB socket dropped) is filled from the replay socket before the
  batch after it is applied. Batches the replica no longer keeps are lost: the index is
  partial for them (logged), and fills again as the replica stores new blocks.
- A sequence number at or below the last one applied is a duplicate (the replay and the
  live socket overlap), unless its batch is newer than the last applied: then the
  replica restarted on the same ports, and the index of it starts over.
- The replica's ``/load`` says how many batches it has sent (``kv_events_sent``): when
  that is ahead of what was applied and the SUB socket is quiet for ``QUIET_S``, the rest
  is asked for from the replay socket. A batch the SUB socket missed at the very end (a
  subscription still joining, say) is so caught up within a health check or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from typing import Any

from sendpath.extras import EXTRAS
from sendpath.kvcache.event_wire import END_SEQ, WireError, decode_batch
from sendpath.router.kv_index import KVIndex
from sendpath.router.pool import EventSource, ReplicaPool

__all__ = ["REPLAY_TIMEOUT_S", "KVEventFollower"]

logger = logging.getLogger("sendpath.gateway.kv_events")

REPLAY_TIMEOUT_S = 5.0  # a replay answer not finished by then is given up (logged)
QUIET_S = 0.5  # no batch for this long while /load says more were sent: replay them


class KVEventFollower:
    """One task per publishing replica, applying its events to ``index``."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._followed: dict[int, tuple[EventSource, asyncio.Task[None]]] = {}
        self._can = all(
            importlib.util.find_spec(m) is not None for m in EXTRAS["kv-events"].modules
        )
        self._said_missing = False
        self.applied: dict[int, int] = {}  # replica -> last sequence number applied
        self._sent: dict[int, int] = {}  # replica -> batches it said it sent (/load)

    @property
    def following(self) -> set[int]:
        """The replicas whose events are followed now."""
        return {i for i, (_, task) in self._followed.items() if not task.done()}

    def sync(self, pool: ReplicaPool) -> None:
        """Follow the replicas that announce events now; forget the others, and those
        that left the pool."""
        present = {e.index for e in pool.endpoints}
        for gone in [i for i in self._followed if i not in present]:
            self._followed.pop(gone)[1].cancel()
            self.index.forget(gone)
            self.applied.pop(gone, None)
            self._sent.pop(gone, None)
        for endpoint in pool.endpoints:
            source, followed = endpoint.events, self._followed.get(endpoint.index)
            self._sent[endpoint.index] = int(endpoint.stats.get("kv_events_sent", 0))
            if followed is not None:
                if followed[0] == source and not followed[1].done():
                    continue
                followed[1].cancel()
                del self._followed[endpoint.index]
                self.index.forget(endpoint.index)
                self.applied.pop(endpoint.index, None)
            if source is None:
                continue
            if not self._can:
                if not self._said_missing:
                    self._said_missing = True
                    logger.warning(
                        "replica %s publishes KV events, but following them needs pyzmq "
                        "and msgpack: pip install 'sendpath[kv-events]'. Routing stays "
                        "approximate.",
                        endpoint.url,
                    )
                continue
            self.index.follow(endpoint.index, source.block_size)
            task = asyncio.create_task(self._follow(endpoint.index, source))
            self._followed[endpoint.index] = (source, task)

    async def aclose(self) -> None:
        tasks = [task for _, task in self._followed.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._followed.clear()

    async def _follow(self, replica: int, source: EventSource) -> None:
        import zmq
        import zmq.asyncio

        sub: Any = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        last, last_ts = -1, float("-inf")
        try:
            last, last_ts = await self._replay(replica, source, last, last_ts)
            while True:
                if not await sub.poll(QUIET_S * 1000):
                    if self._sent.get(replica, 0) - 1 > last:  # more was sent: ask for it
                        last, last_ts = await self._replay(replica, source, last, last_ts)
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big")
                try:
                    ts, events = decode_batch(frames[2])
                except WireError as exc:
                    logger.warning(
                        "replica %d: KV event batch %d unreadable: %s", replica, seq, exc
                    )
                    continue
                if seq <= last:
                    if ts <= last_ts:
                        continue  # already applied (from the replay)
                    logger.info("replica %d restarted: its KV index starts over", replica)
                    self.index.follow(replica, source.block_size)
                    last, last_ts = await self._replay(replica, source, -1, float("-inf"))
                    continue
                if seq > last + 1:
                    last, last_ts = await self._replay(replica, source, last, last_ts)
                    if seq <= last:
                        continue
                self.index.apply(replica, events)
                last, last_ts = seq, ts
                self.applied[replica] = last
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("replica %d: following its KV events stopped", replica)
        finally:
            sub.close(linger=0)

    async def _replay(
        self, replica: int, source: EventSource, last: int, last_ts: float
    ) -> tuple[int, float]:
        """Apply what the replay socket still keeps after ``last``; the new (last, ts)."""
        if source.replay_endpoint is None:
            return last, last_ts
        import zmq
        import zmq.asyncio

        dealer: Any = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.connect(source.replay_endpoint)
        start = last + 1
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 3:
                        continue
                    _, raw, payload = frames
                    if raw == END_SEQ:
                        break
                    seq = int.from_bytes(raw, "big")
                    if seq <= last:
                        continue
                    if seq > last + 1:
                        logger.warning(
                            "replica %d: KV event batches %d-%d are no longer kept; what "
                            "they stored is unknown here until it is used again",
                            replica,
                            last + 1,
                            seq - 1,
                        )
                    ts, events = decode_batch(payload)
                    self.index.apply(replica, events)
                    last, last_ts = seq, ts
                    self.applied[replica] = last
        except TimeoutError:
            logger.warning("replica %d: its KV event replay did not finish", replica)
        except WireError as exc:
            logger.warning("replica %d: a replayed KV event batch is unreadable: %s", replica, exc)
        finally:
            dealer.close(linger=0)
        return last, last_ts
