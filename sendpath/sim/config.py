"""What a simulation is given (``SimConfig``) and what it gives back (``SimResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sendpath.bench.client import RequestResult
from sendpath.config import SchedulerConfig

__all__ = ["ITL_SAMPLE", "MODES", "SimConfig", "SimResult"]

MODES = ("detailed", "fleet")
ITL_SAMPLE = 20_000  # requests whose inter-token gaps are all kept


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 1
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    )
    num_blocks: int = 20_000
    block_size: int = 16
    policy: str = "round_robin"
    mode: str = "detailed"  # or "fleet"
    network_rtt_s: float = 0.02  # client <-> gateway, both ways
    gateway_auth_s: float = 0.0002  # API-key lookup
    gateway_ratelimit_s: float = 0.0002  # bucket check (in memory; Redis adds a round trip)
    gateway_safety_s: float = 0.0001  # prompt filter
    route_s: float = 0.0005  # gateway -> replica hop and routing decision
    tpm: int | None = None  # per tenant: tokens per minute (prompt + max_tokens reserved)
    rpm: int | None = None  # per tenant: requests per minute
    # the output filter's hold on a stream's start: entry h is the share of requests whose
    # first token reaches the client together with the next h (the filter held it while
    # it could still start a blocked phrase); () for none. A served profile measures it.
    first_token_hold: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode is one of {', '.join(MODES)}; got {self.mode!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        hold = self.first_token_hold
        if hold and (min(hold) < 0 or abs(sum(hold) - 1) > 1e-6):
            raise ValueError(f"first_token_hold is shares that add up to 1, got {hold}")

    @property
    def gateway_s(self) -> float:
        return self.gateway_auth_s + self.gateway_ratelimit_s + self.gateway_safety_s


@dataclass
class SimResult:
    results: list[RequestResult]
    duration: float  # virtual seconds from the first arrival to the last answer
    busy: list[float]  # per replica: virtual seconds spent in steps
    kv_peak: list[float]  # per replica: the highest KV-cache usage seen
    num_steps: int
    rejected: int = 0  # 503: a replica's queue was full
    rate_limited: int = 0  # 429: over the tenant's limits
    report: dict[str, Any] = field(default_factory=dict)
