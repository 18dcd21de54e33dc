"""Replica health: passive ejection with exponential backoff, readmission by active checks."""

from __future__ import annotations

from sendpath.clock import VirtualClock
from sendpath.router.pool import BACKOFF_S, EJECT_AFTER, ReplicaPool


def test_ejection_backoff_and_readmission() -> None:
    clock = VirtualClock()
    pool = ReplicaPool(["http://a/", "http://b"], 4, clock)
    a, b = pool.endpoints
    assert a.url == "http://a" and pool.capacity == 8
    for _ in range(EJECT_AFTER - 1):
        assert not pool.failed(a)
    assert pool.failed(a)  # ejected
    assert not a.healthy and pool.candidates() == [b] and pool.capacity == 4
    pool.checked(a, ok=True)  # passing, but the backoff has not run out
    assert not a.healthy
    clock.advance(BACKOFF_S)
    pool.checked(a, ok=True)
    assert a.healthy and a.failures == 0
    for _ in range(EJECT_AFTER):
        pool.failed(a)  # ejected again, straight after: the backoff doubles
    clock.advance(BACKOFF_S)
    pool.checked(a, ok=True)
    assert not a.healthy
    clock.advance(BACKOFF_S)
    pool.checked(a, ok=True)
    assert a.healthy
    pool.succeeded(a)
    assert a.ejections == 0  # a success ends the run of ejections


def test_active_checks_take_out_and_put_back_and_room_is_bounded() -> None:
    pool = ReplicaPool(["http://a"], 2, VirtualClock())
    (a,) = pool.endpoints
    pool.checked(a, ok=False)
    assert pool.candidates() == [] and pool.capacity == 0
    a.in_flight = 1
    pool.checked(a, ok=True, load=5)  # 1 of the 5 is this gateway's own
    assert a.external_load == 4 and a.load == 5 and pool.candidates() == [a]
    a.in_flight = 2
    assert pool.candidates() == [] and pool.candidates({0}) == []


def test_a_dynamic_pool_adds_and_removes_and_never_reuses_an_index() -> None:
    pool = ReplicaPool([], 2, VirtualClock(), dynamic=True)
    assert pool.endpoints == [] and pool.capacity == 0
    a = pool.add("http://a/", "key", reported=True)
    b = pool.add("http://b")
    assert (a.index, a.url, a.api_key, a.reported) == (0, "http://a", "key", True)
    assert pool.capacity == 4 and not b.reported
    pool.remove(a)
    c = pool.add("http://a")  # the same address again is a new replica
    assert [e.name for e in pool.endpoints] == ["replica-1", "replica-2"] and c.index == 2
