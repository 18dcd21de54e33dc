"""A real uvicorn server on loopback, in a thread, serving a tiny random model."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from sendpath.config import ReplicaConfig, SchedulerConfig
from sendpath.engine.async_engine import AsyncEngine
from sendpath.engine.core import EngineCore
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel
from sendpath.runner.model_runner import ModelRunner
from sendpath.server.app import Replica, create_app

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
) -> Iterator[Server]:
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_queued_requests)
    kv = KVCacheManager(BLOCKS, BLOCK)
    core = EngineCore(ModelRunner(loaded, BLOCKS, BLOCK), loaded.tokenizer, kv, sched, MAX_LEN)
    app = create_app(
        ReplicaConfig(served_model_name="tiny", max_body_bytes=64 * 1024), AsyncEngine(core)
    )
    with serve_app(app) as url:
        yield Server(url, app.state.replica)


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yield its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
