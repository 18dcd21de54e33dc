"""The gateway's writes to the daily usage ledger: quota reservations and settles, each a
batch at a time.

Every admitted request of a key with a daily quota reserves what it may use
(``KeyStore.reserve_daily``), and every finished request adds its tokens to its key's
daily usage and drops its reservation (``KeyStore.record_usage``). One SQLite transaction
and one worker-thread hop per request cost too much: settled so, a fifth of the gateway's
CPU per request; reserved so (settles batched), the worker threads took a sixth of a quota
key's CPU at 16 requests in flight (``benchmarks/gateway_overhead.py``). So:

- ``reserve``: a group commit. A request waits for its own answer, but the reservations
  asked while one write is under way go together in the next (one transaction, each
  answered in order as if alone: ``KeyStore.reserve_dailies``), so none waits for a
  timer and a busy gateway writes once for many. (On the event loop instead, when the
  file is free, it measured no better: SQLite lets go of the GIL, so a worker thread's
  write runs beside the loop);
- ``add``: what finishes within ``every_s`` is written in one transaction. Until then a
  request's reservation still counts against its key's quota (it is at least what the
  request used, so the quota is never overrun meanwhile), and ``flush()`` at shutdown
  writes what is left. A process that dies loses at most the last ``every_s`` of usage;
  its reservations expire (``keys.RESERVATION_TTL_S``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from sendpath.gateway.keys import KeyStore

__all__ = ["UsageLedger"]

logger = logging.getLogger("sendpath.gateway")

FLUSH_EVERY_S = 0.05

# A reservation asked: key name, tokens, quota, and where its answer goes
_Ask = tuple[str, int, int, "asyncio.Future[tuple[int | None, int]]"]


class UsageLedger:
    """Batches ``KeyStore.reserve_daily`` and ``KeyStore.record_usage`` calls (module
    docstring)."""

    def __init__(self, keys: KeyStore, every_s: float = FLUSH_EVERY_S) -> None:
        self.keys, self.every_s = keys, every_s
        self._pending: list[tuple[str, int, int | None]] = []
        self._writer: asyncio.Task[None] | None = None
        self._asks: list[_Ask] = []
        self._reserver: asyncio.Task[None] | None = None

    async def reserve(self, name: str, tokens: int, quota: int) -> tuple[int | None, int]:
        """``KeyStore.reserve_daily``, written with the others asked meanwhile. A caller
        cancelled before its answer comes does not hold what was reserved for it."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[int | None, int]] = loop.create_future()
        self._asks.append((name, tokens, quota, answer))
        if self._reserver is None:
            self._reserver = loop.create_task(self._reserve_asked())
        return await answer

    async def _reserve_asked(self) -> None:
        """Write what was asked, batch after batch, until nothing is."""
        batch: list[_Ask] = []
        try:
            while self._asks:
                batch, self._asks = self._asks, []
                try:
                    answers = await asyncio.to_thread(
                        self.keys.reserve_dailies, [ask[:3] for ask in batch]
                    )
                except Exception as exc:  # e.g. the disk is full: each caller is told
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                unwanted = []  # reserved for callers that left meanwhile
                for (*_, future), answer in zip(batch, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
                    elif answer[0] is not None:
                        unwanted.append(answer[0])
                batch = []
                for reservation in unwanted:
                    try:
                        await asyncio.to_thread(self.keys.release, reservation)
                    except sqlite3.Error:  # it expires (keys.RESERVATION_TTL_S)
                        logger.exception("could not release reservation %d", reservation)
        finally:
            self._reserver = None
            for *_, future in batch + self._asks:  # cancelled (shutdown): none waits on
                future.cancel()
            self._asks = []

    def add(self, name: str, tokens: int, reservation: int | None) -> None:
        """A finished request's usage (and its reservation to drop); written within
        ``every_s``."""
        self._pending.append((name, tokens, reservation))
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_soon())

    async def _write_soon(self) -> None:
        try:
            await asyncio.sleep(self.every_s)
        finally:
            self._writer = None
            await self._write()

    async def _write(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await asyncio.to_thread(self.keys.record_usages, batch)
        except sqlite3.Error:  # e.g. the disk is full: keep it for the next write
            logger.exception("could not write %d requests' usage; will retry", len(batch))
            self._pending[:0] = batch

    async def flush(self) -> None:
        """Write everything added so far (at shutdown)."""
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.wait({self._writer})
        await self._write()
