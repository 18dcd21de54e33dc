"""The gateway over HTTP, in front of a real replica: keys, limits, quota, refunds, the
safety filter on input and output, admission, prefix-cache isolation and timings."""

from __future__ import annotations

import concurrent.futures
import gc
import re
import weakref
from pathlib import Path
from typing import Any

import httpx

from sendpath.clock import VirtualClock
from sendpath.gateway.app import YOUNG_THRESHOLD, settle_heap
from sendpath.gateway.keys import KeyStore
from sendpath.gateway.ratelimit import MemoryLimiter
from tests.conftest import wait_for
from tests.gateway.conftest import CHAT, content, gateway
from tests.server.conftest import Server

IDS = {"model": "tiny", "prompt": [7] * 20, "ignore_eos": True}  # estimate == real: 20


def error(r: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


def test_keys_missing_malformed_wrong_and_revoked_get_401(replica: Server, tmp_path: Path) -> None:
    with gateway(replica, tmp_path) as gw:
        good = gw.key("alice")
        assert gw.post(good, {**CHAT, "max_tokens": 2}).status_code == 200
        cases = {
            "missing": {},
            "not bearer": {"Authorization": f"Basic {good}"},
            "not a sendpath key": {"Authorization": "Bearer sk-proj-abc"},
            "no key": {"Authorization": "Bearer"},
            "wrong": {"Authorization": f"Bearer {good[:-4]}XXXX"},
        }
        for name, headers in cases.items():
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401, name
            assert r.headers["www-authenticate"] == "Bearer"
            assert error(r)["code"] == "invalid_api_key", name
        assert (
            "didn't provide an API key"
            in error(httpx.post(gw.url + "/v1/chat/completions", json=CHAT))["message"]
        )
        assert "XXXX" in error(gw.post(good[:-4] + "XXXX", CHAT))["message"]
        # another process's store revokes it: the next request is refused
        KeyStore(tmp_path).revoke("alice")
        r = gw.post(good, {**CHAT, "max_tokens": 2})
        assert r.status_code == 401 and "revoked" in error(r)["message"]
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        assert httpx.get(gw.url + "/health").json()["status"] == "ok"  # open


def test_tpm_limit_429_headers_and_retry_after_is_honoured(replica: Server, tmp_path: Path) -> None:
    reserve = 20 + 1  # prompt ids + max_tokens: each admitted request uses exactly this
    tpm = 30 * reserve  # refills one reservation every 2 s
    clock = VirtualClock()  # the limiter's time stands still until the test moves it
    with gateway(replica, tmp_path, limiter=MemoryLimiter(clock.now)) as gw:
        secret = gw.key("burst", rpm=1000, tpm=tpm)
        body = {**IDS, "max_tokens": 1}
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(lambda _: gw.post(secret, body, "/v1/completions"), range(40)))
        ok = [r for r in answers if r.status_code == 200]
        limited = [r for r in answers if r.status_code == 429]
        assert (len(ok), len(limited)) == (30, 10)  # a full bucket; nothing refilled meanwhile
        h = ok[0].headers
        assert h["x-ratelimit-limit-tokens"] == str(tpm)
        assert h["x-ratelimit-limit-requests"] == "1000"
        assert int(h["x-ratelimit-remaining-tokens"]) <= tpm - reserve
        assert re.fullmatch(r"\d+ms|\d+(\.\d+)?s|\d+m\d+s", h["x-ratelimit-reset-tokens"])
        r = limited[0]
        assert error(r)["type"] == "tokens" and error(r)["code"] == "rate_limit_exceeded"
        assert "tokens per minute" in error(r)["message"]
        assert r.headers["x-ratelimit-remaining-tokens"] == "0"
        wait = int(r.headers["retry-after"])
        assert wait == 2  # one reservation refills in 2 s
        clock.advance(wait - 1)
        assert gw.post(secret, body, "/v1/completions").status_code == 429  # half of it
        clock.advance(1)
        assert gw.post(secret, body, "/v1/completions").status_code == 200
        # a request that can never fit says so
        r = gw.post(secret, {**IDS, "max_tokens": tpm}, "/v1/completions")
        assert r.status_code == 429 and "lower max_tokens" in error(r)["message"]


def test_rpm_limit(replica: Server, tmp_path: Path) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("slow", rpm=2)
        assert [gw.post(secret, {**CHAT, "max_tokens": 1}).status_code for _ in range(2)] == [
            200,
            200,
        ]
        r = gw.post(secret, {**CHAT, "max_tokens": 1})
        assert r.status_code == 429 and error(r)["type"] == "requests"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert 25 <= int(r.headers["retry-after"]) <= 30  # one request per 30 s
        assert "x-ratelimit-limit-tokens" not in r.headers  # no TPM limit on this key


def test_daily_quota_gives_insufficient_quota(replica: Server, tmp_path: Path) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("small", daily_tokens=50)
        r = gw.post(secret, {**IDS, "max_tokens": 30}, "/v1/completions")
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 50
        wait_for(lambda: gw.keys.usage("small") == {"small": (50, 1)})
        r = gw.post(secret, {**IDS, "max_tokens": 1}, "/v1/completions")
        assert r.status_code == 429
        assert error(r)["code"] == "insufficient_quota" and "00:00 UTC" in error(r)["message"]


def _level(limiter: MemoryLimiter, key: str) -> float:
    return limiter._level(key, "tok", 100_000, 0.0)


def test_short_answers_and_aborts_are_refunded(replica: Server, tmp_path: Path) -> None:
    clock = VirtualClock()  # frozen: no refill, so the bucket shows exactly what was used
    limiter = MemoryLimiter(clock.now)
    tpm = 100_000
    with gateway(replica, tmp_path, limiter=limiter) as gw:
        secret = gw.key("refund", tpm=tpm)

        def level() -> float:
            return limiter._level("refund", "tok", tpm, clock.now())

        # learn the greedy answer's first deltas, then stop on the second one
        first = content(gw.stream(secret, {**CHAT, "max_tokens": 3, "temperature": 0}))
        wait_for(lambda: gw.keys.usage("refund"))
        after_first = level()
        body = {**CHAT, "max_tokens": 1000, "temperature": 0, "stop": [first[1]]}
        r = gw.post(secret, body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        used = r.json()["usage"]["total_tokens"]
        assert r.json()["usage"]["completion_tokens"] == 2
        wait_for(lambda: level() == after_first - used)  # 1000 + prompt reserved, the rest back
        # an aborted stream is charged for what was streamed, the rest refunded
        before = level()
        long = {**CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json=long,
            headers={"Authorization": f"Bearer {secret}"},
        ) as s:
            lines = s.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any("content" in line for line in got)
        assert gw.replica.idle()  # the replica aborted it too
        wait_for(lambda: gw.keys.usage("refund")["refund"][1] == 3)
        charged = before - level()
        assert 5 < charged < 100  # prompt estimate + chunks relayed, not 1900
        assert gw.keys.usage("refund")["refund"][0] == tpm - level()  # the ledger agrees


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_settle_heap_collects_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    gc.disable()  # no automatic pass in between: only the function's own collection
    before, threshold = gc.get_freeze_count(), gc.get_threshold()
    try:
        held = [[i] for i in range(1000)]  # alive: frozen
        garbage = weakref.ref(_Node())  # starting's leftover cycle: collected, not frozen
        assert garbage() is not None
        settle_heap()
        assert garbage() is None
        assert gc.get_freeze_count() >= before + len(held)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *threshold[1:])
    finally:  # the rest of the test session collects as before
        gc.unfreeze()
        gc.set_threshold(*threshold)
        gc.enable()
