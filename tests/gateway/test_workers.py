"""`sendpath gateway` as real processes: four workers sharing one TPM limit through a real
redis-server, and the first key created and printed once on a first start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from sendpath.fleet import free_port
from sendpath.gateway.keys import KeyStore
from tests.conftest import child_pids
from tests.server.conftest import Server

RESERVE = 20 + 5  # 20 prompt ids + max_tokens 5, used in full (ignore_eos): no refunds
BODY = {"model": "tiny", "prompt": [7] * 20, "max_tokens": 5, "ignore_eos": True}


@contextmanager
def run_gateway(*args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sendpath.cli", "gateway", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(20)


def test_four_workers_share_one_tpm_limit_through_redis(
    replica: Server, redis_url: str, tmp_path: Path
) -> None:
    tpm = 20 * RESERVE
    secret = KeyStore(tmp_path).create("shared", tpm=tpm)[1]
    args = ["--replica", replica.url, "--data-dir", str(tmp_path), "--redis", redis_url]
    with run_gateway(*args, "--workers", "4") as (url, proc):
        deadline = time.monotonic() + 60
        while len(child_pids(proc.pid)) < 4:
            assert time.monotonic() < deadline, "four workers did not start"
            time.sleep(0.1)

        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                headers = {"Authorization": f"Bearer {secret}"}
                answers = await asyncio.gather(
                    *[
                        client.post(url + "/v1/completions", json=BODY, headers=headers)
                        for _ in range(200)
                    ]
                )
            return [r.status_code for r in answers]

        start = time.monotonic()
        codes = asyncio.run(burst())
        elapsed = time.monotonic() - start
    assert set(codes) <= {200, 429}
    admitted = codes.count(200) * RESERVE
    refilled = tpm * elapsed / 60
    # never more than the limit, what refilled meanwhile, and one reservation
    assert admitted <= tpm + refilled + RESERVE, (codes.count(200), elapsed)
    assert admitted >= tpm // 2  # and the limit did admit (a quarter each would be 4x this)
    assert KeyStore(tmp_path).usage("shared")["shared"][0] == admitted


def test_first_start_creates_and_prints_one_key(replica: Server, tmp_path: Path) -> None:
    args = ["--replica", replica.url, "--data-dir", str(tmp_path)]
    with run_gateway(*args) as (url, proc):
        pass
    out = proc.communicate()[0]
    secret = out.strip().splitlines()[1]
    assert "created key 'default'" in out and secret.startswith("sk-sp-")
    assert KeyStore(tmp_path).verify(secret) is not None
    with run_gateway(*args) as (url, proc):
        r = httpx.post(
            url + "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"}
        )
        assert r.status_code == 200
    assert "sk-sp-" not in proc.communicate()[0]  # shown once, never again
