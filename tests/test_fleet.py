"""`sendpath serve`: the gateway and local replica processes, started and stopped as one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sendpath.cli import build_parser
from sendpath.fleet import LocalFleet, ReplicaStartError
from sendpath.gateway.command import gateway_config
from tests.conftest import child_pids, start_serve


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_serve_starts_two_replicas_answers_and_stops_cleanly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    served = start_serve(tiny_llama_dir, tmp_path)
    proc, url, secret = served.proc, served.url, served.secret
    assert proc.stdout is not None
    replicas = child_pids(proc.pid)
    assert len(replicas) == 2
    health = httpx.get(url + "/health").json()
    assert health["healthy"] == 2 and health["policy"] == "prefix_aware"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    )
    assert r.status_code == 200 and r.headers["x-sendpath-replica"] in ("replica-0", "replica-1")
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


def test_serve_restarts_a_replica_that_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    served = start_serve(tiny_llama_dir, tmp_path, "--no-auth", replicas=1)
    proc, url, lines = served.proc, served.url, served.lines
    assert proc.stdout is not None
    try:
        (first,) = child_pids(proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # back: restarted by serve, healthy, and answering
            replica = httpx.get(url + "/fleet").json()["replicas"][0]
            if replica["restarts"] == 1 and replica["process"] == "running" and replica["healthy"]:
                break
            assert time.monotonic() < deadline, replica
            time.sleep(0.1)
        assert replica["last_exit_code"] == -signal.SIGKILL
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert child_pids(proc.pid) != [first]
    except BaseException:  # in the report: serve's exit code (None: alive) and its output
        print(f"serve's exit code when the test failed: {proc.poll()}")
        proc.kill()
        print("".join(lines) + proc.communicate(timeout=30)[0])
        raise
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert "exited with code -9; starting it again in 1 s (restart 1)" in "".join(lines) + out


def test_serve_gives_a_generated_key_only_to_its_own_replicas() -> None:
    local, outside = ["http://127.0.0.1:9001"], "http://gpu-host:8000"
    args = build_parser().parse_args(["serve", "--replica", outside])
    config = gateway_config(args, [*local, outside], local, "made-here")
    assert config.keys_by_replica() == ("made-here", None)  # never sent off this host
    args = build_parser().parse_args(["serve", "--replica", outside, "--replica-api-key", "k"])
    config = gateway_config(args, [*local, outside], local, "k")
    assert config.keys_by_replica() == ("k", "k")  # the operator's key: for all of them


def test_serve_on_a_taken_port_fails_at_once_without_starting_replicas(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port),
                "--data-dir", str(tmp_path), "--model", str(tiny_llama_dir),
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port} (Address already in use)" in proc.stderr
    assert "or pick another with --port" in proc.stderr
    assert "starting" not in proc.stdout  # no replica was started


def test_ctrl_c_in_a_terminal_stops_serve_and_then_its_replicas(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    served = start_serve(tiny_llama_dir, tmp_path, "--no-auth", replicas=1, session=True)
    proc = served.proc
    (replica,) = child_pids(proc.pid)
    # the terminal signals its foreground group: serve's; the replica has its own group,
    # so only serve hears it and stops the replica once its gateway is done
    assert os.getpgid(replica) != os.getpgid(proc.pid) == proc.pid
    assert httpx.get(served.url + "/health").status_code == 200  # uvicorn's handlers are in
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "sendpath serve: stopped" in out
    assert "starting it again" not in out and not _alive(replica)
