"""Local replica processes for `sendpath serve`: start them, wait until healthy, stop them.

Each replica is a `sendpath replica` child process on a free loopback port. Torch threads
are split between them (``OMP_NUM_THREADS``, unless set) so N replicas on one machine do
not fight over every core. On Linux a replica is told to exit if `serve` dies without
cleaning up (``PR_SET_PDEATHSIG``), so no orphan keeps a port or memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

__all__ = ["LocalFleet", "ReplicaStartError", "free_port", "wait_healthy"]


class ReplicaStartError(RuntimeError):
    """A local replica exited or did not become healthy in time."""


def free_port() -> int:
    """A port on loopback that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_healthy(servers: dict[str, subprocess.Popen[Any]], timeout_s: float) -> None:
    """Block until each server (URL -> its process) answers /health with 200; raise
    ``ReplicaStartError`` if one exits, says it failed, or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = dict(servers)
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise ReplicaStartError(
                    f"the server for {url} exited with code {proc.returncode} while starting "
                    "(its output is above)"
                )
            try:
                r = httpx.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                del pending[url]
            elif r.json().get("status") == "failed":
                raise ReplicaStartError(
                    f"the replica for {url} could not load its model (its log is above)"
                )
        if pending and time.monotonic() > deadline:
            raise ReplicaStartError(
                f"{len(pending)} server(s) not healthy after {timeout_s:g} s: "
                f"{', '.join(pending)}; raise --startup-timeout for a slow model load"
            )
        time.sleep(0.2)


class LocalFleet:
    """N replica processes; a context manager that stops them all on exit."""

    def __init__(self, count: int, engine_args: Sequence[str]) -> None:
        if count < 0:
            raise ValueError(f"--replicas must be >= 0, got {count}")
        self.count, self.engine_args = count, list(engine_args)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, self.count)))
        cmd = [sys.executable, "-m", "sendpath.cli", "replica", "--port", str(port)]
        return subprocess.Popen(cmd + self.engine_args, env=env, preexec_fn=_die_with_parent)

    def start(self) -> None:
        for _ in range(self.count):
            port = free_port()
            self.procs.append(self._spawn(port))
            self.urls.append(f"http://127.0.0.1:{port}")

    def restart(self, i: int) -> None:
        """Start replica ``i`` again on its port (after it exited or was killed)."""
        if self.procs[i].poll() is None:
            self.procs[i].terminate()
            self.procs[i].wait(15)
        self.procs[i] = self._spawn(int(self.urls[i].rsplit(":", 1)[1]))

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until every replica's /health is 200; raise if one exits or time runs out."""
        wait_healthy(dict(zip(self.urls, self.procs, strict=True)), timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every replica (they drain and shut their engines down), then SIGKILL."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
