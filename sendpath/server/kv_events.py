"""The replica's prefix-cache events on the wire, as vLLM publishes them.

``--kv-events-config`` (``config.KVEventsConfig``, vLLM's keys) turns it on. At the end of
each engine step that changed the prefix index, the engine hands its events
(``kvcache/events.py``) to ``KVEventPublisher.publish``, which only queues them: a thread
of its own encodes and sends, so the step does not wait on the network.

The sockets are vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):
- PUB, one multipart message per step: ``(topic, sequence, payload)``; the sequence is an
  8-byte big-endian counter from 0, the payload a msgpack ``KVEventBatch`` in the layout
  of vLLM's structs (``kvcache/event_wire.py``), so a subscriber written against them
  decodes these.
- ROUTER on ``replay_endpoint``: a request ``(b"", start)`` with ``start`` an 8-byte
  big-endian sequence number is answered with every kept batch from ``start`` on, one
  ``(b"", sequence, payload)`` message each, then ``(b"", -1, b"")``. The last
  ``buffer_steps`` batches are kept.

Block hashes are sendpath's (``kvcache/hashing.py``: 16 bytes of BLAKE2b over the parent
hash, the int64 token ids and the tenant's cache salt), so a sendpath gateway computes the
same ones from a prompt's tokens. The events carry prompt tokens: bind the endpoints to a
network only the gateways reach.

When the publisher cannot keep up (``max_queue_size`` steps waiting), later steps' events
are dropped and counted (``dropped``), never waited for: the engine does not slow down for
a subscriber. The subscriber sees the gap in sequence numbers only if the batches were
sent; dropped ones never were, so a drop is logged.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any
from urllib.parse import urlsplit

from sendpath.config import KVEventsConfig
from sendpath.kvcache.event_wire import END_SEQ, encode_batch
from sendpath.kvcache.events import KVEvent

__all__ = ["KVEventPublisher", "binds"]

logger = logging.getLogger("sendpath.kv_events")

POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (``KVEventsConfig``'s rule) or connects."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    if host in ("*", "::", "0.0.0.0", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KVEventPublisher:
    """Publishes each step's events over ZMQ from its own thread (module docstring)."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        import zmq

        self.config, self.medium = config, medium
        self.dropped = 0  # steps whose events were dropped: the queue was full
        self.sent = 0  # batches sent (the next one's sequence number)
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: Any = None
        try:
            self.endpoint = self._open(self._pub, config.endpoint)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint, True)
        except zmq.ZMQError as exc:
            self._close_sockets()
            where = f"{config.endpoint} (replay: {config.replay_endpoint})"
            raise OSError(f"KV events cannot be published on {where}: {exc.strerror}") from exc
        self._thread = threading.Thread(target=self._run, name="sendpath-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: Any, endpoint: str, must_bind: bool = False) -> str:
        """Bind or connect ``socket``; the address subscribers reach it on."""
        import zmq

        if must_bind or binds(endpoint):
            socket.bind(endpoint)
            found: bytes = socket.getsockopt(zmq.LAST_ENDPOINT)
            return found.decode()
        socket.connect(endpoint)
        return endpoint

    @property
    def bound(self) -> bool:
        """Subscribers connect to this replica (else it connects to its subscriber)."""
        return binds(self.config.endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (the engine's thread; never blocks)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning(
                    "KV events: %d steps' events dropped, the publisher is behind "
                    "(max_queue_size %d): subscribers' view of this cache is now partial",
                    self.dropped,
                    self.config.max_queue_size,
                )

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within ``timeout``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        """Send every queued batch, then answer the replay requests waiting: a replay asked
        for after a step ended includes that step's batch."""
        seq = count()
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
                while item is not None:
                    self._send(next(seq), *item)
                    item = self._queue.get_nowait()
                return  # None: closed
            except queue.Empty:
                pass
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()

    def _send(self, n: int, ts: float, events: list[KVEvent]) -> None:
        try:
            payload = encode_batch(ts, events, self.medium)
            self._pub.send_multipart((self._topic, n.to_bytes(8, "big"), payload))
        except Exception:
            logger.exception("KV events: batch %d could not be sent", n)
            return
        self._kept.append((n, payload))
        self.sent = n + 1

    def _answer_replay(self) -> None:
        """Answer one replay request: kept batches from its start, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a malformed replay request was ignored")
            return
        client, _, raw = frames
        start = int.from_bytes(raw, "big")
        for n, payload in list(self._kept):
            if n >= start:
                self._replay.send_multipart((client, b"", n.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
