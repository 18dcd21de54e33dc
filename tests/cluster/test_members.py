"""A gateway whose pool follows the directory: replicas join, report, and leave, on real
replicas (the directory in this process; on Ray it is an actor, ``test_ray_serve.py``)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from sendpath.clock import VirtualClock
from sendpath.cluster.directory import Directory, ReplicaReport, Snapshot
from sendpath.cluster.members import DirectoryFollower, LocalDirectory
from sendpath.config import GatewayConfig
from sendpath.gateway.admission import AdmissionQueue
from sendpath.gateway.app import create_gateway_app
from sendpath.model.loader import LoadedModel
from sendpath.router.policy import make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.router.router import Router
from tests.conftest import wait_for
from tests.server.conftest import serve, serve_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def push(d: Directory, replica: str, url: str, status: str = "ok") -> None:
    load = httpx.get(url + "/load").json() if status == "ok" else {}
    d.report(ReplicaReport(replica, url, f"node-{replica}", "host-1", status, load))


def fleet(gateway: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(gateway + "/fleet").json()["replicas"]
    return found


def test_the_pool_follows_the_directory(tiny: LoadedModel, tmp_path: Path) -> None:
    d = Directory()
    followers: list[DirectoryFollower] = []

    def members(router: Router, queue: AdmissionQueue) -> DirectoryFollower:
        followers.append(DirectoryFollower(LocalDirectory(d), router, None, lambda: 3))
        return followers[0]

    config = GatewayConfig(require_keys=False, policy="round_robin", data_dir=str(tmp_path))
    with ExitStack() as stack:
        a = stack.enter_context(serve(tiny)).url
        b = stack.enter_context(serve(tiny)).url
        gateway = stack.enter_context(serve_app(create_gateway_app(config, members=members)))
        assert fleet(gateway) == []  # nothing reported yet: nothing to route to
        push(d, "a", a)
        push(d, "b", b)
        wait_for(lambda: len(fleet(gateway)) == 2)
        names = {r["runs_on"]["node"]: r["name"] for r in fleet(gateway)}
        assert set(names) == {"node-a", "node-b"}
        assert all(r["healthy"] and r["runs_on"]["host"] == "host-1" for r in fleet(gateway))
        for _ in range(4):
            r = httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=30)
            assert r.status_code == 200, r.text
        trace = httpx.get(f"{gateway}/v1/traces/{r.json()['id']}").json()
        assert trace["routing"]["policy"] == "round_robin"  # where it ran, and why there
        assert (
            trace["routing"]["runs_on"]["node"]
            == {v: k for k, v in names.items()}[r.headers["x-sendpath-replica"]]
        )
        push(d, "a", a)  # the next reports carry what the replicas did
        push(d, "b", b)
        wait_for(
            lambda: all(r["prefix_cache_hit_rate"] is not None for r in fleet(gateway))
        )  # both took requests (round robin), as their own reports say
        assert d.queued_total() == 3  # the gateway said how many wait in its queue

        push(d, "b", b, status="stuck")  # pushed health counts, as a failed check would
        wait_for(lambda: [r["healthy"] for r in fleet(gateway)] == [True, False])
        d.leave("b")  # the replica stopped: forgotten
        wait_for(lambda: [r["runs_on"]["node"] for r in fleet(gateway)] == ["node-a"])
        assert all(
            httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
            for _ in range(3)
        )
        follower = followers[0]
        assert list(follower.members) == ["a"]
        assert follower.router.pool.endpoints[0].reported  # no active check polls it


def test_a_gateway_starts_with_the_replicas_already_reported(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """`serve --ray` prints that it listens once the replicas are up: the first request
    after that finds them (the follower's first answer is taken before the app starts)."""
    d = Directory()

    def members(router: Router, queue: AdmissionQueue) -> DirectoryFollower:
        return DirectoryFollower(SlowDirectory(d), router, None, lambda: 0)

    config = GatewayConfig(require_keys=False, data_dir=str(tmp_path))
    with ExitStack() as stack:
        push(d, "a", stack.enter_context(serve(tiny)).url)
        gateway = stack.enter_context(serve_app(create_gateway_app(config, members=members)))
        assert [r["runs_on"]["node"] for r in fleet(gateway)] == ["node-a"]  # no waiting
        r = httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200, r.text


class SlowDirectory(LocalDirectory):
    """An actor's answer comes over the network: a while after the call (the start waits
    for it up to FIRST_TIMEOUT_S, 10 s)."""

    async def watch(self, version: int, timeout_s: float) -> Snapshot:
        await asyncio.sleep(0.2)
        return await super().watch(version, timeout_s)


class Silent:
    """A directory that never answers (its actor restarting)."""

    async def watch(self, version: int, timeout_s: float) -> Snapshot:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def queued(self, gateway_id: str, waiting: int) -> None:
        return None


def test_a_silent_directory_does_not_stop_the_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = Router(ReplicaPool([], 1, VirtualClock(), dynamic=True), make_policy("round_robin"))
    follower = DirectoryFollower(Silent(), router, None, lambda: 0)
    with caplog.at_level(logging.WARNING, "sendpath.cluster"):
        asyncio.run(follower.first(timeout_s=0.01))
    assert follower.members == {} and follower.version == -1
    assert "did not answer at start" in caplog.text
