"""Admission: slots, a queue fair across keys, time-outs and a full queue (503 + Retry-After)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest

from sendpath.errors import ServiceUnavailableError
from sendpath.gateway.admission import AdmissionQueue
from tests.gateway.conftest import CHAT, gateway
from tests.server.conftest import Server


def test_lines_are_served_round_robin_across_keys() -> None:
    async def run() -> list[str]:
        queue = AdmissionQueue(capacity=1, max_waiting=10, timeout_s=5)
        await queue.acquire("heavy")  # the one slot
        order: list[str] = []

        async def one(key: str) -> None:
            await queue.acquire(key)
            order.append(key)

        tasks = [asyncio.create_task(one(k)) for k in ["heavy"] * 3 + ["light"]]
        await asyncio.sleep(0)
        assert queue.num_waiting == 4
        for _ in range(4):
            queue.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert queue.num_in_flight == 1 and queue.num_waiting == 0
        return order

    # "light" came last but is served second: one request per key in turn
    assert asyncio.run(run()) == ["heavy", "light", "heavy", "heavy"]


def test_full_queue_timeout_and_cancel_lose_no_slot() -> None:
    async def run() -> None:
        queue = AdmissionQueue(capacity=1, max_waiting=1, timeout_s=0.05)
        await queue.acquire("a")
        waiter = asyncio.create_task(queue.acquire("b"))
        await asyncio.sleep(0)
        with pytest.raises(ServiceUnavailableError, match="at capacity"):
            await queue.acquire("c")  # the queue is full: refused at once
        with pytest.raises(ServiceUnavailableError, match="timed out"):
            await waiter
        assert queue.num_waiting == 0
        cancelled = asyncio.create_task(queue.acquire("d"))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        queue.release()
        assert (queue.num_in_flight, queue.num_waiting) == (0, 0)
        await queue.acquire("e")  # the slot is free again
        assert queue.num_in_flight == 1

    asyncio.run(run())


def test_over_http_waiting_times_out_and_a_full_queue_refuses_at_once(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(
        replica,
        tmp_path,
        max_inflight_per_replica=1,
        max_queued_requests=1,
        queue_timeout_s=1.0,
        require_keys=False,
    ) as gw:
        long = {**CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=long) as hold:
            lines = hold.iter_lines()
            next(lines)  # the one slot is taken while this stream is open
            results: dict[str, httpx.Response] = {}
            waiting = threading.Thread(
                target=lambda: results.update(w=gw.post(None, {**CHAT, "max_tokens": 1}))
            )
            waiting.start()
            _until_waiting(gw.url)
            r = gw.post(None, {**CHAT, "max_tokens": 1})  # the queue (1) is full
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "at capacity" in r.json()["error"]["message"]
            waiting.join()
            r = results["w"]
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "timed out" in r.json()["error"]["message"]
        assert gw.replica.idle()
        assert gw.post(None, {**CHAT, "max_tokens": 1}).status_code == 200


def _until_waiting(url: str) -> None:
    for _ in range(500):
        if httpx.get(url + "/health").json().get("waiting") == 1:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the second request never queued")
