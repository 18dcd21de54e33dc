"""Settling finished requests into the usage ledger, a batch at a time.

Every finished request adds its tokens to its key's daily usage and drops its quota
reservation (``KeyStore.record_usage``). One SQLite transaction and one worker-thread hop
per request was a fifth of the gateway's CPU per request; ``UsageLedger`` collects what
finishes within ``every_s`` and writes it in one transaction. Until then a request's
reservation still counts against its key's quota (it is at least what the request used,
so the quota is never overrun meanwhile), and ``flush()`` at shutdown writes what is left.
A process that dies loses at most the last ``every_s`` of usage; its reservations expire
(``keys.RESERVATION_TTL_S``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from sendpath.gateway.keys import KeyStore

__all__ = ["UsageLedger"]

logger = logging.getLogger("sendpath.gateway")

FLUSH_EVERY_S = 0.05


class UsageLedger:
    """Batches ``KeyStore.record_usage`` calls (module docstring)."""

    def __init__(self, keys: KeyStore, every_s: float = FLUSH_EVERY_S) -> None:
        self.keys, self.every_s = keys, every_s
        self._pending: list[tuple[str, int, int | None]] = []
        self._writer: asyncio.Task[None] | None = None

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
