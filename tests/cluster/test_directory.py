"""The directory: replicas' pushed reports, expiry of the silent, the gateways' queues."""

from __future__ import annotations

import asyncio

from sendpath.cluster.directory import EXPIRE_S, GATEWAY_EXPIRE_S, Directory, ReplicaReport


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def report(replica: str, status: str = "ok", running: int = 0) -> ReplicaReport:
    return ReplicaReport(
        replica, f"http://127.0.0.1:{8000 + len(replica)}", "node-" + replica, "host", status,
        {"num_requests_running": running, "num_requests_waiting": 0},
    )  # fmt: skip


def test_reports_upsert_and_the_silent_expire() -> None:
    clock = Clock()
    d = Directory(clock)
    d.report(report("a"))
    d.report(report("bb", running=3))
    d.report(report("a", running=1))  # the same replica again: one entry, the last report
    snap = d.snapshot()
    assert [(r.replica_id, r.load["num_requests_running"]) for r in snap.replicas] == [
        ("a", 1),
        ("bb", 3),
    ]
    clock.t += EXPIRE_S / 2
    d.report(report("a"))
    clock.t += EXPIRE_S / 2 + 0.1  # bb has said nothing for longer than EXPIRE_S
    later = d.snapshot()
    assert [r.replica_id for r in later.replicas] == ["a"] and later.version > snap.version
    d.leave("a")
    assert d.snapshot().replicas == ()
    d.report(report("a"))  # a report sent before it left, arriving after: not taken back
    assert d.snapshot().replicas == ()


def test_a_replicas_share_of_the_gateways_queues() -> None:
    clock = Clock()
    d = Directory(clock)
    d.queued("gw1", 6)
    d.queued("gw2", 2)
    assert d.report(report("a")) == 8.0  # the only replica carries all of it
    assert d.report(report("bb")) == 4.0  # two share it
    clock.t += GATEWAY_EXPIRE_S + 1
    d.queued("gw2", 2)  # gw1 stopped reporting: its queue no longer counts
    assert d.report(report("a")) == 1.0


def test_watch_answers_on_a_change_or_after_its_timeout() -> None:
    async def main() -> None:
        d = Directory()
        first = await d.watch(-1, 5.0)  # newer than -1 already: at once
        assert first.version == 0 and first.replicas == ()
        quiet = await d.watch(first.version, 0.01)  # nothing changes: the timeout
        assert quiet.version == first.version
        waiting = asyncio.create_task(d.watch(first.version, 30.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        d.report(report("a"))
        changed = await asyncio.wait_for(waiting, 5.0)
        assert [r.replica_id for r in changed.replicas] == ["a"]

    asyncio.run(main())


def test_start_failures_are_kept_for_serve_to_show() -> None:
    d = Directory()
    assert d.last_error() is None
    for i in range(40):
        d.failed(f"replica could not start: {i}")
    assert d.last_error() == "replica could not start: 39" and len(d.errors) == 16
