"""The usage ledger writes what finishes within its interval in one transaction, and
whatever is left at shutdown; the reservations asked while one is written go together in
the next."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from sendpath.gateway.keys import KeyStore
from sendpath.gateway.ledger import UsageLedger


class CountingStore(KeyStore):
    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.writes: list[int] = []
        self.reserved: list[int] = []  # each reservation write's number of asks
        self.released: list[int] = []
        self.fail_release = False
        self.fail_next = False

    def record_usages(self, entries: Any, day: str | None = None) -> None:
        if self.fail_next:
            self.fail_next = False
            raise sqlite3.OperationalError("database or disk is full")
        self.writes.append(len(entries))
        super().record_usages(entries, day)

    def reserve_dailies(self, asks: Any) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise sqlite3.OperationalError("database or disk is full")
        self.reserved.append(len(asks))
        return super().reserve_dailies(asks)

    def release(self, reservation: int) -> None:
        if self.fail_release:
            self.fail_release = False
            raise sqlite3.OperationalError("database or disk is full")
        self.released.append(reservation)
        super().release(reservation)


def test_requests_finished_together_are_written_in_one_transaction(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    store.create("a", daily_tokens=1000)
    reservation, _ = store.reserve_daily("a", 100, 1000)

    async def run() -> None:
        ledger = UsageLedger(store, every_s=60)  # only flush() writes
        for tokens in (10, 20, 30):
            ledger.add("a", tokens, None)
        ledger.add("a", 40, reservation)
        assert store.writes == [] and store.usage("a") == {}
        await ledger.flush()

    asyncio.run(run())
    assert store.writes == [4]
    assert store.usage("a") == {"a": (100, 4)}
    assert store.reserve_daily("a", 900, 1000)[0] is not None  # the reservation was dropped


def test_a_batch_written_after_its_interval_and_kept_when_the_write_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CountingStore(tmp_path)
    store.create("a")

    async def run() -> None:
        ledger = UsageLedger(store, every_s=0.01)
        store.fail_next = True
        ledger.add("a", 5, None)
        while not caplog.records:  # the failed write was logged
            await asyncio.sleep(0.01)
        ledger.add("a", 7, None)
        while store.usage("a") == {}:  # the next interval writes both
            await asyncio.sleep(0.01)
        await ledger.flush()

    asyncio.run(run())
    assert store.usage("a") == {"a": (12, 2)}
    assert store.writes == [2]
    assert "could not write 1 requests' usage" in caplog.text


def test_reservations_asked_together_are_one_write_each_answered_in_order(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    store.create("a", daily_tokens=100)

    async def run() -> list[tuple[int | None, int]]:
        ledger = UsageLedger(store)
        together = await asyncio.gather(*(ledger.reserve("a", t, 100) for t in (40, 50, 30)))
        return [*together, await ledger.reserve("a", 10, 100)]

    answers = asyncio.run(run())
    assert [left for _, left in answers] == [60, 10, 10, 0]
    assert [reservation is not None for reservation, _ in answers] == [True, True, False, True]
    assert store.reserved == [3, 1]  # the three asked at once, then the one asked after


async def asked_then_left(ledger: UsageLedger) -> None:
    """A caller asks key "a" for 60 tokens and is cancelled before its answer comes."""
    caller = asyncio.create_task(ledger.reserve("a", 60, 100))
    await asyncio.sleep(0)  # it asked
    caller.cancel()


def test_a_reservation_whose_caller_left_is_released_and_a_failed_write_is_raised(
    tmp_path: Path,
) -> None:
    store = CountingStore(tmp_path)
    store.create("a", daily_tokens=100)

    async def run() -> None:
        ledger = UsageLedger(store)
        await asked_then_left(ledger)
        while not store.released:  # reserved for no one: given back
            await asyncio.sleep(0.01)
        assert await ledger.reserve("a", 100, 100) == (store.released[0] + 1, 0)
        store.fail_next = True
        with pytest.raises(sqlite3.OperationalError, match="disk is full"):
            await ledger.reserve("a", 1, 100)

    asyncio.run(run())
    assert store.reserved == [1, 1]


def test_a_release_that_fails_is_logged_and_the_next_reservation_still_made(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CountingStore(tmp_path)
    store.create("a", daily_tokens=100)

    async def run() -> None:
        ledger = UsageLedger(store)
        await asked_then_left(ledger)
        store.fail_release = True  # when its reservation is given back
        while not caplog.records:
            await asyncio.sleep(0.01)
        assert await ledger.reserve("a", 40, 100) == (2, 0)  # the 60 stay until they expire

    asyncio.run(run())
    assert "could not release reservation 1" in caplog.text
