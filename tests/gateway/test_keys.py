"""KeyStore: hashed keys, revocation seen by other processes, the usage ledger."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from sendpath.gateway.keys import KeyStore, KeyStoreError


def test_create_verify_and_store_only_hashes(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    key, secret = store.create("alice", rpm=10, tpm=1000, daily_tokens=5000)
    assert secret.startswith("sk-sp-") and len(secret) == 46
    assert key.hint == secret[:10]
    assert store.verify(secret) == key
    assert store.verify(secret + "x") is None and store.verify("sk-sp-nope") is None
    raw = sqlite3.connect(tmp_path / "keys.sqlite3").execute("SELECT * FROM keys").fetchall()
    assert secret not in repr(raw)  # only the SHA-256 is stored


def test_revocation_is_seen_by_another_process_store(tmp_path: Path) -> None:
    a, b = KeyStore(tmp_path), KeyStore(tmp_path)  # two gateway processes, one data dir
    _, secret = a.create("bob")
    assert b.verify(secret) is not None
    a.revoke("bob")
    assert b.verify(secret) is None
    assert [k.name for k in b.list()] == ["bob"] and not b.list()[0].active
    with pytest.raises(KeyStoreError, match="no active key named 'bob'"):
        a.revoke("bob")


def test_bad_names_and_limits(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    store.create("team-1")
    with pytest.raises(KeyStoreError, match="already exists"):
        store.create("team-1")
    with pytest.raises(KeyStoreError, match="letters, digits"):
        store.create("bad name!")
    with pytest.raises(KeyStoreError, match="--tpm must be >= 1"):
        store.create("zero", tpm=0)


def test_usage_ledger_adds_up_per_day(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    store.record_usage("alice", 100, day="2026-11-30")
    store.record_usage("alice", 50, day="2026-11-30")
    store.record_usage("bob", 7, day="2026-11-30")
    store.record_usage("alice", 1, day="2026-12-01")
    assert store.usage(day="2026-11-30") == {"alice": (150, 2), "bob": (7, 1)}
    assert store.usage("alice", day="2026-12-01") == {"alice": (1, 1)}


def test_daily_reservations_are_atomic_across_threads_and_stores(tmp_path: Path) -> None:
    stores = [KeyStore(tmp_path) for _ in range(4)]  # four gateway processes, one file
    stores[0].create("q", daily_tokens=500)
    granted: list[int] = []

    def admit(store: KeyStore) -> None:
        for _ in range(10):
            reservation, _ = store.reserve_daily("q", 60, 500)
            if reservation is not None:
                granted.append(reservation)

    threads = [threading.Thread(target=admit, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 8  # 8 x 60 = 480 <= 500 < 9 x 60, however they interleave
    assert stores[1].reserve_daily("q", 21, 500) == (None, 20)
    stores[2].record_usage("q", 10, reservation=granted[0])  # used 10 of its 60
    assert stores[3].reserve_daily("q", 70, 500)[0] is not None  # the 50 came back
    for r in granted[1:]:
        stores[0].release(r)
    assert stores[0].usage("q") == {"q": (10, 1)}


def test_a_found_key_is_read_again_once_any_client_changes_the_keys_table(
    tmp_path: Path,
) -> None:
    store = KeyStore(tmp_path)
    _, secret = store.create("carol", rpm=10)
    key = store.lookup(secret, wait=False)
    assert key is not None and key.rpm == 10
    assert store.lookup(secret, wait=False) is key  # kept: the keys table did not change
    store.record_usage("carol", 5)  # the usage ledger is not the keys table
    assert store.lookup(secret, wait=False) is key
    with sqlite3.connect(tmp_path / "keys.sqlite3") as db:  # any SQLite client, any process
        db.execute("UPDATE keys SET rpm = 20 WHERE name = 'carol'")
    changed = store.lookup(secret, wait=False)
    assert changed is not None and changed.rpm == 20
    with sqlite3.connect(tmp_path / "keys.sqlite3") as db:
        db.execute("DELETE FROM keys WHERE name = 'carol'")
    assert store.lookup(secret, wait=False) is None
