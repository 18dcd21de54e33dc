"""`sendpath serve`: the gateway and local replica processes, started and stopped as one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sendpath.fleet import LocalFleet, ReplicaStartError, free_port
from tests.conftest import child_pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_serve_starts_two_replicas_answers_and_stops_cleanly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port),
            "--replicas", "2", "--data-dir", str(tmp_path), "--model", str(tiny_llama_dir),
            "--served-model-name", "tiny", "--kv-cache-memory-gib", "0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not any("Ctrl-C stops everything" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    secret = next(line.strip() for line in lines if line.startswith("sk-sp-"))
    replicas = child_pids(proc.pid)
    assert len(replicas) == 2
    url = f"http://127.0.0.1:{port}"
    health = httpx.get(url + "/health").json()
    assert health["healthy"] == 2 and health["policy"] == "prefix_aware"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    )
    assert r.status_code == 200 and r.headers["x-sendpath-replica"].startswith("http://127.0.0.1:")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert "sendpath serve: stopped" in proc.stdout.read()
    assert not any(_alive(pid) for pid in replicas)  # no replica outlives serve


def test_a_replica_that_cannot_start_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with LocalFleet(1, ["--model", str(bad)]) as fleet:
        try:
            fleet.wait_healthy(60)
        except ReplicaStartError as exc:
            message = str(exc)
        else:
            raise AssertionError("a broken model became healthy")
    assert "could not load its model" in message
