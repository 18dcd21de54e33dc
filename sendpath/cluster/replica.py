"""One sendpath replica as a Ray Serve deployment replica.

Serve places it by its resources (``ray_actor_options``), restarts it when it dies or
fails its health check, and scales the deployment. Inside, it is the replica `sendpath
replica` runs: the same app (``server/app.py``) on its own HTTP port on the node's
address, so gateways reach it directly, stream tokens from it and choose it by their own
policy (Serve's router is not on the token path). Serve's hooks map to the engine's:

- ``__init__`` loads the model and returns once the replica takes requests (a model that
  cannot load fails the replica's start, which Serve reports and retries);
- ``check_health`` raises when the engine stopped or a step is stuck (the replica's
  ``/health`` status), so Serve replaces it;
- ``record_autoscaling_stats``: what the autoscaling policy reads (``autoscale.py``);
- ``__del__`` (Serve stopping it, e.g. scaling down): it leaves the directory, so gateways
  send it nothing new, lets the requests it holds finish (``DRAIN_S`` at most), then stops.

Every ``REPORT_INTERVAL_S`` it pushes its status and load to the directory
(``directory.py``), which feeds the gateways' routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import replace
from typing import Any

from sendpath.cluster.autoscale import GATEWAY_QUEUED, ONGOING
from sendpath.cluster.directory import REPORT_INTERVAL_S, ReplicaReport, open_directory
from sendpath.config import ReplicaConfig

__all__ = ["DRAIN_S", "ServeReplica"]

logger = logging.getLogger("sendpath.cluster")

DRAIN_S = 20.0  # a replica being stopped lets its requests finish for this long at most
STARTED_POLL_S = 0.05


def node_address(node_id: str) -> str:
    """The address Ray knows the node by (what other nodes reach it on)."""
    import ray

    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    raise RuntimeError(f"Ray does not list this replica's node {node_id}")


class ServeReplica:
    """The deployment's class (``fleet.py`` wraps it with ``serve.deployment``)."""

    async def __init__(self, config: ReplicaConfig) -> None:  # type: ignore[misc]
        import ray
        import uvicorn
        from ray import serve

        from sendpath.api.http_server import uvicorn_config
        from sendpath.server.app import create_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = node_address(self.node_id)
        if config.kv_events.publishes:
            config = replace(config, kv_events=config.kv_events.on_node(self.host))
        self.failed = False
        self.app = create_app(config, on_engine_failure=self._engine_failed)
        self.replica = self.app.state.replica
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))  # the port is this replica's from here on
        port = sock.getsockname()[1]
        bracketed = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{bracketed}:{port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, self.host, port, config.connection))
        self.serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        self.queue_share = 0.0
        self.directory = open_directory()
        while self.replica.status == "loading" and not self.serving.done():
            await asyncio.sleep(STARTED_POLL_S)
        if self.replica.status != "ok" or not self.server.started:
            why = repr(self.replica.load_error) if self.replica.load_error else None
            await self._stop()
            message = f"sendpath replica could not start: {why or 'its HTTP server stopped'}"
            with contextlib.suppress(Exception):  # `serve` shows it, Serve's message does not
                await self.directory.failed.remote(message)
            raise RuntimeError(message)
        self.reporting = asyncio.create_task(self._report_loop())
        logger.info("replica %s serving on %s (node %s)", self.replica_id, self.url, self.host)

    def _engine_failed(self) -> None:
        self.failed = True  # check_health says so; Serve replaces this replica

    def report(self) -> ReplicaReport:
        status = self.replica.status
        load = self.replica.load_report() if status == "ok" else {}
        return ReplicaReport(
            self.replica_id, self.url, self.node_id, socket.gethostname(), status, load
        )

    async def _report_loop(self) -> None:
        while True:
            try:
                self.queue_share = float(await self.directory.report.remote(self.report()))
            except Exception as exc:  # the directory restarting: the next round fills it
                logger.warning("replica %s: report not taken (%s)", self.replica_id, exc)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def check_health(self) -> None:
        status = self.replica.status
        if self.failed or status in ("failed", "stuck") or self.serving.done():
            raise RuntimeError(f"sendpath replica {self.replica_id} is {status}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        engine = self.replica.engine
        held = 0.0
        if engine is not None:
            held = float(engine.snapshot.num_running + engine.snapshot.num_waiting)
        return {ONGOING: held, GATEWAY_QUEUED: self.queue_share}

    async def __call__(self, request: Any) -> dict[str, Any]:
        """Serve's own entry (a handle call): where this replica is and how it is."""
        return {"url": self.url, "status": self.replica.status, "node": self.host}

    async def __del__(self) -> None:
        """Serve stops this replica: leave the directory, drain, stop."""
        reporting: asyncio.Task[None] | None = getattr(self, "reporting", None)
        if reporting is not None:
            reporting.cancel()
            with contextlib.suppress(Exception):
                await self.directory.leave.remote(self.replica_id)
        self.replica.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        while len(self.replica.active) and loop.time() < deadline:
            await asyncio.sleep(STARTED_POLL_S)
        await self._stop()

    async def _stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving
