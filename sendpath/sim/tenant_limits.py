"""The gateway's per-tenant limits in a simulation: its token buckets on the virtual clock.

A request reserves its prompt and ``max_tokens`` against its tenant's tokens-per-minute
and requests-per-minute when it reaches the gateway (over them: a 429), and settles what
it really used when it ends, as ``gateway/ratelimit.py`` does for a served request.
"""

from __future__ import annotations

from sendpath.clock import SettableClock
from sendpath.gateway.ratelimit import Limits, MemoryLimiter
from sendpath.sim.config import SimConfig
from sendpath.sim.traffic import SimRequest

__all__ = ["TenantLimits"]


class TenantLimits:
    """``config``'s ``tpm`` and ``rpm`` per tenant (``SimRequest.tenant``)."""

    def __init__(self, config: SimConfig) -> None:
        self.on = config.tpm is not None or config.rpm is not None
        self.settles = config.tpm is not None  # only tokens are reserved ahead
        self._clock = SettableClock()  # the limiter's own time (no cycle back to the sim)
        self._limits = Limits(config.rpm, config.tpm)
        self._limiter = MemoryLimiter(clock=self._clock.now)

    @staticmethod
    def _reserved(req: SimRequest) -> int:
        return len(req.prompt) + req.output_len

    def allows(self, t: float, req: SimRequest) -> bool:
        """Reserve ``req``'s tokens at ``t``; False: over its tenant's limits (429)."""
        if not self.on:
            return True
        self._clock.set(t)
        key = f"tenant-{req.tenant}"
        return self._limiter.reserve(key, self._limits, self._reserved(req)).allowed

    def settle(self, t: float, req: SimRequest, used: int) -> None:
        """``req`` ended at ``t`` having used ``used`` tokens: its reservation is trued up."""
        if self.settles:
            self._clock.set(t)
            key = f"tenant-{req.tenant}"
            self._limiter.settle(key, self._limits, self._reserved(req), used)
