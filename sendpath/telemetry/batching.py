"""A bounded queue of encoded spans and the thread that sends them in batches.

What the SDK's ``BatchSpanProcessor`` does, for spans that are bytes already: a request
only appends to a deque (the SDK's ``on_end`` reads the item's context, the process id
and a lock-guarded event: 1.5 us a request alone, three times that in a loaded
gateway); the thread wakes when a batch is full or ``delay_s`` has passed, and sends
what is queued, a batch at a time. Past ``max_queue`` requests or ``MAX_QUEUE_BYTES``
waiting, spans are dropped (a collector that is down or slow never holds a request or
grows the process), and a batch is cut at ``MAX_BATCH_BYTES`` too (a client's largest
allowed request has 68 kB of spans: 2,048 of them would be a post collectors refuse).
Sizes and the delay come from ``OTEL_BSP_MAX_QUEUE_SIZE``,
``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` and ``OTEL_BSP_SCHEDULE_DELAY`` (milliseconds) where
set, as for the SDK's processor.

A forked child does not send: its parent's sender (its connections) is not its own; the
servers here start their processes fresh, never forked from a running one.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
import weakref
from typing import Protocol

__all__ = ["Sender", "SpanQueue"]

logger = logging.getLogger("sendpath.telemetry")

DELAY_S = 5.0  # the SDK's OTEL_BSP_SCHEDULE_DELAY default
MAX_QUEUE_BYTES = 64 << 20  # spans waiting, at most (typically 1.3 kB a request)
MAX_BATCH_BYTES = 8 << 20  # a post, at most (the SDK's own limit is 64 MiB; collectors' 4-32)
DROP_LOG_S = 60.0  # at most one warning a minute about dropped spans


def _env_int(name: str, default: int) -> int:
    """A positive integer from the environment; a value that is not one is warned about
    and ``default`` used, as the SDK does."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        logger.warning("%s=%r is not a positive integer; using %d", name, text, default)
        return default
    return value


class Sender(Protocol):
    def send(self, batch: list[bytes]) -> bool:
        """Send one batch of requests' encoded spans, in order; whether the collector
        took them."""

    def shutdown(self) -> None:
        """Nothing more will be sent."""


class SpanQueue:
    """Encoded spans waiting for ``sender``, sent a batch at a time from a thread of
    its own."""

    def __init__(self, sender: Sender, max_queue: int, max_batch: int) -> None:
        self.sender = sender
        self.max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", max_queue)
        batch = _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", max_batch)
        if batch > self.max_queue:
            logger.warning(
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE %d is more than the queue holds; using %d",
                batch,
                self.max_queue,
            )
        self.max_batch = min(batch, self.max_queue)
        self.delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", int(DELAY_S * 1000)) / 1000
        self.dropped = 0  # spans dropped because the queue was full
        # bytes queued = in - out: each counter has one writer (put's thread, the sender)
        self._bytes_in = self._bytes_out = 0
        self._dropped_logged_at = float("-inf")
        self._queue: collections.deque[bytes] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._abandoned = False  # shut down before the queue was sent: send no more
        self._thread: threading.Thread | None = None  # started by the first put
        self._lock = threading.Lock()  # starting the thread
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def put(self, spans: bytes) -> None:
        """Queue one request's spans (dropped if the queue is full or shut down); from
        one thread at a time (a server's event loop)."""
        queue = self._queue
        queued = self._bytes_in - self._bytes_out
        if len(queue) >= self.max_queue or queued + len(spans) > MAX_QUEUE_BYTES:
            self._drop()
            return
        if self._stopping:  # at exit, or in a forked child: not sent
            return
        self._bytes_in += len(spans)
        queue.append(spans)
        if self._thread is None:
            self._start()
        if len(queue) >= self.max_batch and not self._wake.is_set():
            self._wake.set()

    def shutdown(self, timeout_s: float) -> None:
        """Send what is queued, for at most ``timeout_s``, then shut the sender; nothing
        is queued after. Past that time what is still queued is dropped and the send
        under way is not retried (the OTLP client's backoff ends at its shutdown), so the
        thread ends: a collector that refuses no longer keeps it retrying, and one that
        hangs holds it for that one request's timeout (the thread is a daemon and never
        holds the process)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                self._abandoned = True
                logger.warning(
                    "span export still under way after %.1f s at shutdown: %d requests' "
                    "spans still queued are dropped",
                    timeout_s,
                    len(self._queue),
                )
        self.sender.shutdown()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name="sendpath-span-export", daemon=True
                )
                thread.start()  # may raise (no threads left): the next put tries again
                self._thread = thread

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._send_queued()
        self._send_queued()

    def _send_queued(self) -> None:
        queue = self._queue
        while queue and not self._abandoned:
            first = queue.popleft()  # one at least, whatever its size
            batch, size = [first], len(first)
            while queue and len(batch) < self.max_batch:
                if size + len(queue[0]) > MAX_BATCH_BYTES:
                    break
                spans = queue.popleft()
                batch.append(spans)
                size += len(spans)
            self._bytes_out += size
            try:
                self.sender.send(batch)
            except Exception:  # a collector's failure is never the process's
                logger.exception("%d requests' spans could not be sent", len(batch))

    def _drop(self) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged_at >= DROP_LOG_S:
            self._dropped_logged_at = now
            logger.warning(
                "span export queue full (%d requests' spans): dropping; %d dropped so far",
                self.max_queue,
                self.dropped,
            )

    def _forked(self) -> None:
        """In a forked child: the parent's thread and connections are not its own; it
        sends nothing (module docstring)."""
        self._queue = collections.deque()
        self._bytes_in = self._bytes_out = 0
        self._stopping = True


def _forked(ref: weakref.ReferenceType[SpanQueue]) -> None:
    queue = ref()
    if queue is not None:
        queue._forked()
