"""A real gateway (uvicorn, in a thread) in front of a real replica serving a tiny model,
and a real redis-server."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sendpath.config import GatewayConfig
from sendpath.gateway.app import create_gateway_app
from sendpath.gateway.keys import KeyStore
from sendpath.model.loader import LoadedModel
from tests.conftest import require_program
from tests.server.conftest import Server, serve, serve_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}


@dataclass
class Gateway:
    url: str
    keys: KeyStore
    replica: Server
    app: Any  # the gateway app, to look at its parts

    def key(self, name: str, **limits: int | None) -> str:
        return self.keys.create(name, **limits)[1]

    def post(
        self, secret: str | None, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def stream(self, secret: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
        """The SSE events of a streamed chat request: parsed chunks, and "[DONE]"."""
        events: list[dict[str, Any] | str] = []
        with httpx.stream(
            "POST",
            self.url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=60,
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events


def content(events: list[dict[str, Any] | str]) -> list[str]:
    """The text deltas of a chat stream, in order."""
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            text = e["choices"][0]["delta"].get("content")
            if text:
                out.append(text)
    return out


@contextmanager
def gateway(replica: Server, data_dir: Path, **options: Any) -> Iterator[Gateway]:
    limiter, safety = options.pop("limiter", None), options.pop("safety", None)
    tracing = options.pop("tracing", None)
    config = GatewayConfig(replicas=(replica.url,), data_dir=str(data_dir), **options)
    app = create_gateway_app(config, limiter=limiter, safety=safety, tracing=tracing)
    with serve_app(app) as url:
        yield Gateway(url, app.state.keys, replica, app)


@pytest.fixture(scope="module")
def replica(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny) as s:
        yield s


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free loopback port, without persistence."""
    server = require_program("redis-server", "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)
