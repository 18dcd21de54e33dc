"""Token buckets: exact arithmetic in memory, the same on a real Redis, shared by processes."""

from __future__ import annotations

import math
import multiprocessing
import socket
import time

import pytest

from sendpath.gateway.ratelimit import (
    Limits,
    MemoryLimiter,
    RedisLimiter,
    StoreUnavailableError,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_bucket_arithmetic() -> None:
    clock = FakeClock()
    lim = MemoryLimiter(clock)
    limits = Limits(rpm=2, tpm=600)
    d = lim.reserve("k", limits, 500)
    assert d.allowed and d.remaining_requests == 1 and d.remaining_tokens == 100
    assert d.reset_tokens_s == pytest.approx(50.0)  # 500 tokens at 10 tokens/s
    d = lim.reserve("k", limits, 200)  # 100 tokens left: wait for 100 more at 10/s
    assert not d.allowed and d.retry_after_s == pytest.approx(10.0)
    assert d.remaining_tokens == 100  # a refusal takes nothing
    clock.now += 10.0
    d = lim.reserve("k", limits, 200)
    assert d.allowed and d.remaining_requests == 0
    d = lim.reserve("k", limits, 1)  # request bucket empty: 1 request per 30 s
    assert not d.allowed and d.retry_after_s == pytest.approx(30.0 - 10.0)


def test_settle_refunds_unused_tokens_and_too_large_never_fits() -> None:
    clock = FakeClock()
    lim = MemoryLimiter(clock)
    limits = Limits(rpm=None, tpm=1000)
    assert lim.reserve("k", limits, 900).allowed
    lim.settle("k", limits, reserved=900, used=100)
    assert lim.reserve("k", limits, 900).allowed  # 800 refunded
    d = lim.reserve("k", limits, 5000)
    assert not d.allowed and d.retry_after_s == math.inf
    assert lim.reserve("other", limits, 1000).allowed  # keys are independent


def test_redis_bucket_matches_memory_semantics(redis_url: str) -> None:
    lim = RedisLimiter(redis_url, prefix="test1:")
    limits = Limits(rpm=2, tpm=600)
    d = lim.reserve("k", limits, 500)
    assert d.allowed and d.remaining_requests == 1 and d.remaining_tokens == 100
    d = lim.reserve("k", limits, 200)
    assert not d.allowed and 9.5 < d.retry_after_s <= 10.0 and d.remaining_tokens == 100
    lim.settle("k", limits, reserved=500, used=50)  # 450 back
    d = lim.reserve("k", limits, 200)
    assert d.allowed and d.remaining_requests == 0 and 349 <= (d.remaining_tokens or 0) <= 352
    assert lim.reserve("k", Limits(rpm=None, tpm=600), 601).retry_after_s == math.inf


def _worker(url: str, n: int, tokens: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    lim = RedisLimiter(url, prefix="shared:")
    limits = Limits(rpm=None, tpm=6000)
    out.put(sum(tokens for _ in range(n) if lim.reserve("one-key", limits, tokens).allowed))


def test_processes_share_one_limit(redis_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    start = time.monotonic()
    procs = [ctx.Process(target=_worker, args=(redis_url, 50, 100, out)) for _ in range(4)]
    for p in procs:
        p.start()
    admitted = sum(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    elapsed = time.monotonic() - start
    # 200 reservations of 100 tokens against 6000 TPM: at most the bucket plus its refill
    # during the run (100 tokens/s) plus one reservation in flight
    assert 6000 <= admitted <= 6000 + 100 * elapsed + 100


def test_unreachable_redis_falls_back_to_per_process_limits() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens here once the socket closes
    lim = RedisLimiter(f"redis://127.0.0.1:{dead}/0")
    limits = Limits(rpm=1, tpm=None)
    assert lim.reserve("k", limits, 10).allowed
    assert not lim.reserve("k", limits, 10).allowed  # still limited, in this process


def test_unreachable_redis_fails_closed_when_asked_and_counts_every_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    errors: list[int] = []
    lim = RedisLimiter(
        f"redis://127.0.0.1:{dead}/0", fail_open=False, on_error=lambda: errors.append(1)
    )
    limits = Limits(rpm=100, tpm=None)
    for _ in range(3):
        with pytest.raises(StoreUnavailableError) as refused:
            lim.reserve("k", limits, 10)
    assert refused.value.status_code == 503 and "--redis-failure closed" in refused.value.message
    assert len(errors) == 1  # one failed call; then Redis rests a second, not asked again


def test_a_refused_request_gets_its_request_back(redis_url: str) -> None:
    for lim in (MemoryLimiter(FakeClock()), RedisLimiter(redis_url, prefix="refund:")):
        limits = Limits(rpm=2, tpm=1000)
        assert lim.reserve("k", limits, 100).allowed
        lim.settle("k", limits, reserved=100, used=0, refund_request=True)  # e.g. a 400
        assert lim.reserve("k", limits, 100).allowed
        assert lim.reserve("k", limits, 100).allowed  # 2 RPM: both still there
        assert not lim.reserve("k", limits, 100).allowed
