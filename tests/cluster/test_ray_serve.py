"""`sendpath serve --ray` on a real multi-node Ray cluster on this machine (a head and
three worker nodes of one CPU each, on loopback): replicas on different nodes answer
through the gateway; a removed node's replica moves and is forgotten with no failed
request; held requests add a replica and an idle fleet shrinks to its minimum."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sendpath.model.kernels import cpu_kernels
from tests.conftest import wait_for

if importlib.util.find_spec("ray") is None:
    if os.environ.get("CI"):
        pytest.fail("CI must not skip: ray is not installed (the test extra has it)")
    pytest.skip("needs the ray extra: pip install 'sendpath[ray]'", allow_module_level=True)

# "0" (tests/conftest.py sets it): Ray keeps its nodes on 127.0.0.1, here and in every
# process the cluster starts, which inherit it.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

if ray_constants.ENABLE_RAY_CLUSTER:  # Ray was imported before tests/conftest.py set it
    pytest.fail(f"Ray would leave loopback: {LOOPBACK_ENV}=0 must be set before importing it")
OBJECT_STORE = 80 * 2**20
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cpu_kernels()  # built once here; the replicas find them
    head = {"num_cpus": 0, "object_store_memory": OBJECT_STORE, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(3):
            c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()  # type: ignore[no-untyped-call]


@dataclass
class RayServe:
    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def fleet(self) -> list[dict[str, Any]]:
        replicas: list[dict[str, Any]] = httpx.get(self.url + "/fleet").json()["replicas"]
        return replicas

    def chat(self, **extra: Any) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)


def start(cluster: Cluster, model: Path, data: Path, *flags: str) -> RayServe:
    # --port 0: serve takes a free port before it deploys (Ray's processes start meanwhile
    # and bind ports of their own) and prints it when it listens
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sendpath.cli", "serve", "--ray", cluster.address,
            "--port", "0", "--no-auth", "--data-dir", str(data), "--model", str(model),
            "--served-model-name", "tiny", "--kv-cache-memory-gib", "0.05", *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    served = RayServe(proc, "")
    assert proc.stdout is not None
    out = proc.stdout

    def read() -> None:  # Ray forwards its workers' logs: keep the pipe drained
        for line in out:
            served.lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while not (up := [line for line in served.lines if "Ctrl-C stops everything" in line]):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(served)
            pytest.fail("".join(served.lines[-60:]))
        time.sleep(0.05)
    served.url = up[0].split()[2].removesuffix("/v1")
    return served


def stop(served: RayServe) -> None:
    if served.proc.poll() is None:
        served.proc.terminate()
        try:
            served.proc.wait(60)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait()


def worker_of(cluster: Cluster, node_id: str) -> Any:
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


@pytest.fixture(scope="class")
def served(
    cluster: Cluster, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayServe]:
    """Two replicas, round robin (the class's tests share it)."""
    data = tmp_path_factory.mktemp("ray-data")
    served = start(cluster, tiny_llama_dir, data, "--replicas", "2", "--policy", "round_robin")
    try:
        yield served
    finally:
        stop(served)
    assert "the Serve app is deleted" in "".join(served.lines)


class TestFixedFleet:
    def test_replicas_on_two_nodes_answer_through_the_gateway(self, served: RayServe) -> None:
        wait_for(lambda: len(served.fleet()) == 2 and all(r["healthy"] for r in served.fleet()))
        nodes = {r["runs_on"]["node"] for r in served.fleet()}
        assert len(nodes) == 2  # one CPU per worker: Ray put them on different nodes
        assert all(r["url"].startswith("http://127.0.0.1:") for r in served.fleet())
        for _ in range(4):
            r = served.chat()
            assert r.status_code == 200, r.text
        # each replica's own pushed report says it answered (round robin: two each)
        wait_for(lambda: all(r["prefix_cache_hit_rate"] is not None for r in served.fleet()))

    def test_a_removed_node_moves_its_replica_and_no_request_fails(
        self, served: RayServe, cluster: Cluster
    ) -> None:
        wait_for(lambda: len(served.fleet()) == 2 and all(r["healthy"] for r in served.fleet()))
        gone = served.fleet()[0]
        cluster.remove_node(worker_of(cluster, gone["runs_on"]["node"]))
        answered = [served.chat().status_code for _ in range(6)]  # sent right after
        assert answered == [200] * 6

        def moved() -> bool:
            now = served.fleet()
            nodes = {r["runs_on"]["node"] for r in now}
            return (
                len(now) == 2
                and all(r["healthy"] for r in now)
                and gone["runs_on"]["node"] not in nodes
                and gone["name"] not in {r["name"] for r in now}
            )

        wait_for(moved, timeout=120)  # Serve started it again on the spare node
        health = httpx.get(served.url + "/health").json()
        assert gone["url"] not in {r["url"] for r in health["replicas"]}  # forgotten
        assert all(served.chat().status_code == 200 for _ in range(4))


def test_held_requests_add_a_replica_and_idle_shrinks_to_the_minimum(
    cluster: Cluster, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    while len(cluster.worker_nodes) < 2:  # the class above removed one
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    scaling = {
        "upscale_delay_s": 0,
        "downscale_delay_s": 1,
        "metrics_interval_s": 0.25,
        "look_back_period_s": 0.5,
    }
    served = start(
        cluster, tiny_llama_dir, tmp_path,
        "--replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
        "--target-ongoing-requests", "1", "--max-inflight-per-replica", "1",
        "--ray-autoscaling-config", json.dumps(scaling),
        "--kv-events-config", '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:1"}',
    )  # fmt: skip
    try:
        assert len(served.fleet()) == 1
        holding = threading.Event()
        statuses: list[int] = []

        def keep_busy() -> None:  # three requests at a time until told to stop
            while not holding.is_set():
                r = served.chat(max_tokens=200, ignore_eos=True)
                statuses.append(r.status_code)

        with ThreadPoolExecutor(3) as pool:
            for _ in range(3):
                pool.submit(keep_busy)
            try:  # 1 running at the replica, 2 in the gateway's queue: 3 over a target of 1
                wait_for(lambda: sum(r["healthy"] for r in served.fleet()) == 2, timeout=120)
            finally:
                holding.set()
        assert statuses and set(statuses) == {200}
        assert len({r["runs_on"]["node"] for r in served.fleet()}) == 2
        # the new replica publishes KV events too, and this gateway follows them
        wait_for(lambda: [r["prefix_routing"]["mode"] for r in served.fleet()] == ["precise"] * 2)
        wait_for(lambda: len(served.fleet()) == 1, timeout=120)  # idle: back to the minimum
        assert served.chat().status_code == 200
    finally:
        stop(served)
