"""Local replica processes for `sendpath serve`: start them, wait until healthy, stop them.

Each replica is a `sendpath replica` child process on a free loopback port. Torch threads
are split between them (``OMP_NUM_THREADS``, unless set) so N replicas on one machine do
not fight over every core. On Linux a replica is told to exit if `serve` dies without
cleaning up (``PR_SET_PDEATHSIG``), so no orphan keeps a port or memory. Each replica gets
the fleet's API key in its environment (not on its command line, where `ps` shows it), so
only the gateway can use it.

``supervise()`` watches them: a replica that exits (its engine failed, it crashed, it was
killed) is started again on its port after a backoff that starts at ``BACKOFF_S`` and
doubles on each exit in a row up to ``MAX_BACKOFF_S`` (a replica up for ``STABLE_S``
starts over at ``BACKOFF_S``), and says so in the log; ``status()`` is what `/fleet`
shows of each.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from sendpath.config import KVEventsConfig

__all__ = ["LocalFleet", "ReplicaStartError", "free_port", "wait_healthy"]

logger = logging.getLogger("sendpath.serve")

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
WATCH_INTERVAL_S = 0.25


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
                r = httpx.get(url + "/ready", timeout=1)
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


@dataclass
class _Supervised:
    """What the supervisor knows of one replica process."""

    started_at: float
    state: str = "running"  # or "restarting" (exited, waiting out its backoff)
    restarts: int = 0
    last_exit_code: int | None = None
    backoff_s: float = BACKOFF_S
    restart_at: float = 0.0


class LocalFleet:
    """N replica processes; a context manager that stops them all on exit."""

    def __init__(
        self,
        count: int,
        engine_args: Sequence[str],
        api_key: str | None = None,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        """``kv_events``: each replica publishes its cache's events, on ports of its own
        (``KVEventsConfig.for_replica``)."""
        if count < 0:
            raise ValueError(f"--replicas must be >= 0, got {count}")
        self.count, self.engine_args, self.api_key = count, list(engine_args), api_key
        self.kv_events = kv_events if kv_events is not None and kv_events.publishes else None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self._states: list[_Supervised] = []
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def _spawn(self, port: int, index: int) -> subprocess.Popen[bytes]:
        from sendpath.server.command import API_KEY_ENV

        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, self.count)))
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        cmd = [sys.executable, "-m", "sendpath.cli", "replica", "--port", str(port)]
        if self.kv_events is not None:
            cmd += ["--kv-events-config", self.kv_events.for_replica(index).to_json()]
        # a process group of its own: a terminal's Ctrl-C reaches `serve` alone, whose
        # gateway finishes its requests before it stops the replicas (not all at once,
        # nor a replica restarted while the gateway winds down); it dies with `serve`
        return subprocess.Popen(
            cmd + self.engine_args, env=env, preexec_fn=_die_with_parent, process_group=0
        )

    def start(self) -> None:
        for i in range(self.count):
            port = free_port()
            self.procs.append(self._spawn(port, i))
            self.urls.append(f"http://127.0.0.1:{port}")
            self._states.append(_Supervised(time.monotonic()))

    def restart(self, i: int) -> None:
        """Start replica ``i`` again on its port (after it exited or was killed)."""
        if self.procs[i].poll() is None:
            self.procs[i].terminate()
            self.procs[i].wait(15)
        self.procs[i] = self._spawn(int(self.urls[i].rsplit(":", 1)[1]), i)

    def supervise(self) -> None:
        """Start the thread that restarts replicas that exit (see the module docstring)."""
        self._watcher = threading.Thread(target=self._watch, name="sendpath-fleet", daemon=True)
        self._watcher.start()

    def status(self) -> dict[str, dict[str, Any]]:
        """Each replica's process state by URL: state, restarts, last exit code."""
        return {
            url: {
                "process": st.state,
                "restarts": st.restarts,
                "last_exit_code": st.last_exit_code,
            }
            for url, st in zip(self.urls, self._states, strict=True)
        }

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            try:
                self._look()
            except Exception:  # e.g. a restart that could not spawn: try again next time
                logger.exception("the replica supervisor hit an error; it goes on")

    def _look(self) -> None:
        """One look at every replica: restart those whose backoff is over, note exits."""
        now = time.monotonic()
        for i, st in enumerate(self._states):
            if st.state == "restarting":
                if now >= st.restart_at and not self._stopping.is_set():
                    st.restart_at = now + st.backoff_s  # if this fails, the next try waits
                    self.restart(i)
                    st.state, st.started_at = "running", now
                    logger.warning("replica %s started again", self.urls[i])
                continue
            code = self.procs[i].poll()
            if code is None:
                if now - st.started_at >= STABLE_S:
                    st.backoff_s = BACKOFF_S
                continue
            st.state, st.last_exit_code, st.restarts = "restarting", code, st.restarts + 1
            st.restart_at = now + st.backoff_s
            logger.warning(
                "replica %s exited with code %s; starting it again in %g s (restart %d)",
                self.urls[i],
                code,
                st.backoff_s,
                st.restarts,
            )
            st.backoff_s = min(MAX_BACKOFF_S, 2 * st.backoff_s)

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until every replica's /health is 200; raise if one exits or time runs out."""
        wait_healthy(dict(zip(self.urls, self.procs, strict=True)), timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every replica (they drain and shut their engines down), then SIGKILL."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(5)
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
