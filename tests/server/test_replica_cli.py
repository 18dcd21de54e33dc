"""`sendpath replica` as a user starts it: loading, serving the built-in model, clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sendpath.config import EngineConfig, ReplicaConfig
from sendpath.server.app import create_app
from tests.server.conftest import serve_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replica_serves_the_builtin_model_and_stops_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sendpath.cli",
            "replica",
            "--port",
            str(port),
            "--kv-cache-memory-gib",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{url}/ready", timeout=2)
                alive = httpx.get(f"{url}/health", timeout=2)
                statuses.append(r.json()["status"])
                assert alive.status_code == 200  # alive while loading, and after
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json() == {"status": "loading"}
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert statuses and statuses[-1] == "ok"
        assert "loading" in statuses  # the server is up before the model is
        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={
                "model": "SmolLM2-135M-Instruct",
                "temperature": 0,
                "max_tokens": 20,
                "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
            },
        )
        assert r.status_code == 200 and "Tokyo" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "replica SmolLM2-135M-Instruct stopped: engine shut down" in out
    assert f"serving SmolLM2-135M-Instruct on {url}" in out


def test_a_model_that_fails_to_load_makes_health_say_failed(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    app = create_app(ReplicaConfig(engine=EngineConfig(model=str(bad))))
    with serve_app(app) as url:
        deadline = time.monotonic() + 30
        while (r := httpx.get(f"{url}/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        assert httpx.get(f"{url}/ready").status_code == 503
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "broken", "messages": []})
        assert chat.status_code == 503 and chat.headers["retry-after"] == "1"
        assert "failed" in chat.json()["error"]["message"]
