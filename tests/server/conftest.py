"""A real uvicorn server on loopback, in a thread, serving a tiny random model."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp

from sendpath.api.http_server import uvicorn_config
from sendpath.config import ConnectionLimits, KVEventsConfig, ReplicaConfig, SchedulerConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore, Runner
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel
from sendpath.runner.model_runner import ModelRunner
from sendpath.server.app import Replica, create_app
from sendpath.telemetry.export import Tracing

BLOCKS, BLOCK, MAX_LEN = 256, 16, 2048


@dataclass
class Server:
    url: str
    replica: Replica

    @property
    def core(self) -> EngineCore:
        assert self.replica.engine is not None
        return self.replica.engine.core

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request is in the engine and every KV block is free."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = httpx.get(f"{self.url}/load").json()
            free = self.core.scheduler.kv.pool.num_free_blocks
            if (
                stats["num_requests_running"] == 0
                and stats["num_requests_waiting"] == 0
                and free == BLOCKS
            ):
                return True
            time.sleep(0.02)
        return False


@contextmanager
def serve(
    loaded: LoadedModel,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    max_queued_requests: int | None = None,
    limits: ConnectionLimits | None = None,
    api_key: str | None = None,
    runner: Callable[[ModelRunner], Runner] | None = None,
    on_engine_failure: Callable[[], None] | None = None,
    stuck_step_s: float = 120.0,
    kv_events: KVEventsConfig | None = None,
    tracing: Tracing | None = None,
) -> Iterator[Server]:
    """A replica of ``loaded`` in this process (``runner``: wraps the model runner)."""
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_queued_requests)
    kv = KVCacheManager(BLOCKS, BLOCK)
    model_runner = ModelRunner(loaded, BLOCKS, BLOCK)
    used = runner(model_runner) if runner is not None else model_runner
    core = EngineCore(used, loaded.tokenizer, kv, sched, MAX_LEN)
    config = ReplicaConfig(
        served_model_name="tiny",
        max_body_bytes=64 * 1024,
        api_key=api_key,
        connection=limits or ConnectionLimits(),
        stuck_step_s=stuck_step_s,
        kv_events=kv_events or KVEventsConfig(),
    )
    app = create_app(config, AsyncEngine(core), on_engine_failure, tracing)
    with serve_app(app, limits) as url:
        yield Server(url, app.state.replica)


@contextmanager
def serve_app(app: ASGIApp, limits: ConnectionLimits | None = None) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yield its URL.
    ``limits``: serve it with the guarded protocol, as the commands do."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # a request still in flight at the end (a replica that hangs on purpose) is cut after
    # a second, as a real server's would be by its supervisor, instead of holding the join
    options: dict[str, Any] = {"lifespan": "on", "timeout_graceful_shutdown": 1}
    if limits is not None:
        config = uvicorn_config(app, "127.0.0.1", port, limits, **options)
    else:
        config = uvicorn.Config(app, log_level="warning", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny) as s:
        yield s
