"""Per-key rate limits in requests and tokens per minute: token buckets, in memory or Redis.

Algorithm: two token buckets per key, one counting requests (capacity RPM) and one counting
tokens (capacity TPM), each refilled continuously at capacity / 60 per second. Admission
takes 1 from the request bucket and ``prompt + max_tokens`` from the token bucket, both or
neither; when the request ends, ``settle`` gives back what it reserved and did not use.
A bucket may not start with more than its capacity, so a burst is bounded by one minute's
allowance (unlike a fixed window, which admits two minutes' worth across a boundary).

Backends: ``MemoryLimiter`` (one process) and ``RedisLimiter`` (atomic Lua scripts on
Redis's clock, so several gateway processes share one limit). Redis is asked with a short
socket timeout (``REDIS_TIMEOUT_S``); every failed call counts in ``on_error`` (the
``sendpath:gateway_store_errors`` metric), and for ``REDIS_COOLDOWN_S`` after a failure
Redis is not asked at all (a blackholed Redis would otherwise cost every request the
timeout, twice, on the worker threads everyone shares). Meanwhile, by ``fail_open``:

- open (the default): a ``MemoryLimiter`` in this process decides instead, so limits hold
  per process rather than across the fleet (availability over strictness), and the next
  call tries Redis again;
- closed: the request is refused with 503 (``StoreUnavailableError``) until Redis answers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sendpath.errors import ServiceUnavailableError

__all__ = [
    "Decision",
    "Limits",
    "MemoryLimiter",
    "RateLimiter",
    "RedisLimiter",
    "StoreUnavailableError",
    "make_limiter",
]

logger = logging.getLogger("sendpath.gateway")

REDIS_TIMEOUT_S = 0.25
REDIS_COOLDOWN_S = 1.0


class StoreUnavailableError(ServiceUnavailableError):
    """The shared limit store (Redis) did not answer and the gateway fails closed (503)."""

    code = "rate_limit_store_unavailable"

    def __init__(self) -> None:
        super().__init__(
            "The rate limiter's store is unreachable and this gateway refuses requests until "
            "it is back (it runs with --redis-failure closed). Retry in a moment."
        )


@dataclass(frozen=True)
class Limits:
    rpm: int | None
    tpm: int | None


@dataclass(frozen=True)
class Decision:
    """The answer to one admission, with what the ``x-ratelimit-*`` headers report."""

    allowed: bool
    retry_after_s: float  # 0 when allowed; math.inf when the request can never fit
    remaining_requests: int | None
    remaining_tokens: int | None
    reset_requests_s: float  # until the request bucket is full again
    reset_tokens_s: float


class RateLimiter(Protocol):
    blocking: bool  # its calls wait on the network: the gateway makes them on a worker thread

    def reserve(self, key: str, limits: Limits, tokens: int) -> Decision:
        """Take 1 request and ``tokens`` tokens, both or neither."""
        ...

    def settle(
        self, key: str, limits: Limits, reserved: int, used: int, refund_request: bool = False
    ) -> None:
        """Give back the ``reserved - used`` tokens not used (and the request, if it was
        refused before it reached a replica)."""
        ...


def _refill(level: float, stamp: float, now: float, capacity: int) -> float:
    return min(float(capacity), level + (now - stamp) * capacity / 60.0)


class MemoryLimiter:
    """Token buckets in this process (thread-safe)."""

    blocking = False

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[
            tuple[str, str], tuple[float, float]
        ] = {}  # (key, kind) -> level, stamp

    def _level(self, key: str, kind: str, capacity: int, now: float) -> float:
        level, stamp = self._buckets.get((key, kind), (float(capacity), now))
        return _refill(level, stamp, now, capacity)

    def reserve(self, key: str, limits: Limits, tokens: int) -> Decision:
        with self._lock:
            now = self._clock()
            wanted = (("req", limits.rpm, 1), ("tok", limits.tpm, tokens))
            need = [(k, cap, cost) for k, cap, cost in wanted if cap is not None]
            levels = {k: self._level(key, k, cap, now) for k, cap, _ in need}
            wait = 0.0
            for k, cap, cost in need:
                if cost > cap:
                    wait = math.inf
                elif levels[k] < cost:
                    wait = max(wait, (cost - levels[k]) * 60.0 / cap)
            if wait == 0.0:
                for k, _, cost in need:
                    levels[k] -= cost
            for k, _, _ in need:
                self._buckets[(key, k)] = (levels[k], now)
            return _decision(wait, limits, levels.get("req"), levels.get("tok"))

    def settle(
        self, key: str, limits: Limits, reserved: int, used: int, refund_request: bool = False
    ) -> None:
        with self._lock:
            now = self._clock()
            if limits.tpm is not None and reserved != used:
                level = self._level(key, "tok", limits.tpm, now)
                refilled = min(float(limits.tpm), level + reserved - used)
                self._buckets[(key, "tok")] = (refilled, now)
            if refund_request and limits.rpm is not None:
                level = self._level(key, "req", limits.rpm, now)
                self._buckets[(key, "req")] = (min(float(limits.rpm), level + 1), now)


def _decision(wait: float, limits: Limits, req: float | None, tok: float | None) -> Decision:
    def reset(level: float | None, cap: int | None) -> float:
        return 0.0 if level is None or cap is None else max(0.0, (cap - level) * 60.0 / cap)

    return Decision(
        allowed=wait == 0.0,
        retry_after_s=wait,
        remaining_requests=None if req is None else max(0, math.floor(req)),
        remaining_tokens=None if tok is None else max(0, math.floor(tok)),
        reset_requests_s=reset(req, limits.rpm),
        reset_tokens_s=reset(tok, limits.tpm),
    )


# KEYS: request bucket, token bucket. ARGV: rpm, tpm, tokens (0 capacity = unlimited).
# Returns {allowed, wait_ms, req_level_milli, tok_level_milli} (-1 level = unlimited).
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local levels = {}
local wait = 0
for i = 1, 2 do
  if caps[i] > 0 then
    local b = redis.call('HMGET', KEYS[i], 'level', 'stamp')
    local level = tonumber(b[1]) or caps[i]
    local stamp = tonumber(b[2]) or now
    level = math.min(caps[i], level + (now - stamp) * caps[i] / 60.0)
    levels[i] = level
    if costs[i] > caps[i] then wait = -1
    elseif level < costs[i] and wait >= 0 then
      wait = math.max(wait, (costs[i] - level) * 60.0 / caps[i])
    end
  end
end
for i = 1, 2 do
  if caps[i] > 0 then
    if wait == 0 then levels[i] = levels[i] - costs[i] end
    redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'stamp', tostring(now))
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
local function milli(i)
  if caps[i] > 0 then return math.floor(levels[i] * 1000) end
  return -1
end
local allowed = 0
if wait == 0 then allowed = 1 end
return {allowed, math.floor(wait * 1000), milli(1), milli(2)}
"""

# KEYS: request bucket, token bucket. ARGV: rpm, tpm (0 = unlimited), refunds (tokens may
# be negative: used more than reserved).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for i = 1, 2 do
  local cap = tonumber(ARGV[i])
  local refund = tonumber(ARGV[i + 2])
  if cap > 0 and refund ~= 0 then
    local b = redis.call('HMGET', KEYS[i], 'level', 'stamp')
    local level = tonumber(b[1]) or cap
    local stamp = tonumber(b[2]) or now
    level = math.min(cap, math.min(cap, level + (now - stamp) * cap / 60.0) + refund)
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'stamp', tostring(now))
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
return 1
"""


class RedisLimiter:
    """The same buckets in Redis, shared by every gateway process that points at it."""

    blocking = True

    def __init__(
        self,
        url: str,
        prefix: str = "sendpath:rl:",
        fail_open: bool = True,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        import redis

        self._client = redis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        self._reserve = self._client.register_script(_RESERVE)
        self._settle = self._client.register_script(_SETTLE)
        self._prefix = prefix
        self._fallback = MemoryLimiter()
        self._fail_open = fail_open
        self._on_error = on_error
        self._warned = False
        self._resting_until = 0.0  # time.monotonic() before which Redis is not asked

    def _keys(self, key: str) -> list[str]:
        return [f"{self._prefix}{{{key}}}:req", f"{self._prefix}{{{key}}}:tok"]

    def _resting(self) -> bool:
        return time.monotonic() < self._resting_until

    def _degraded(self, exc: Exception) -> None:
        self._resting_until = time.monotonic() + REDIS_COOLDOWN_S
        self._on_error()
        if not self._warned:
            what = "limits now per process" if self._fail_open else "requests refused (503)"
            logger.warning("Redis unreachable (%s): %s until it returns", exc, what)
            self._warned = True

    def reserve(self, key: str, limits: Limits, tokens: int) -> Decision:
        import redis

        try:
            if self._resting():
                raise redis.ConnectionError("Redis failed less than a second ago")
            allowed, wait_ms, req, tok = self._reserve(
                keys=self._keys(key), args=[limits.rpm or 0, limits.tpm or 0, tokens]
            )
        except redis.RedisError as exc:
            if not self._resting():
                self._degraded(exc)
            if not self._fail_open:
                raise StoreUnavailableError() from exc
            return self._fallback.reserve(key, limits, tokens)
        self._warned = False
        wait = math.inf if wait_ms < 0 else (0.0 if allowed else max(wait_ms / 1000, 0.001))
        return _decision(
            wait, limits, None if req < 0 else req / 1000, None if tok < 0 else tok / 1000
        )

    def settle(
        self, key: str, limits: Limits, reserved: int, used: int, refund_request: bool = False
    ) -> None:
        import redis

        tokens = reserved - used if limits.tpm is not None else 0
        requests = 1 if refund_request and limits.rpm is not None else 0
        if not tokens and not requests:
            return
        try:
            if self._resting():
                raise redis.ConnectionError("Redis failed less than a second ago")
            self._settle(
                keys=self._keys(key), args=[limits.rpm or 0, limits.tpm or 0, requests, tokens]
            )
        except redis.RedisError as exc:
            if not self._resting():
                self._degraded(exc)
            self._fallback.settle(key, limits, reserved, used, refund_request)


def make_limiter(
    redis_url: str | None, fail_open: bool = True, on_error: Callable[[], None] = lambda: None
) -> RateLimiter:
    """The limiter backend for a gateway: Redis when a URL is given, else in memory."""
    if not redis_url:
        return MemoryLimiter()
    return RedisLimiter(redis_url, fail_open=fail_open, on_error=on_error)
