"""Component configs: one small dataclass each, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheConfig", "EngineConfig", "GatewayConfig", "ReplicaConfig", "SchedulerConfig"]


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take, and who goes first.

    ``max_num_batched_tokens`` is the per-step token budget (decodes + prefill chunks);
    a prompt longer than what is left of it is prefilled in chunks over several steps.
    ``max_queued_requests`` bounds the waiting queue (``None`` = unbounded).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queued_requests: int | None = None
    policy: str = "fcfs"  # "fcfs" or "priority"
    # vLLM's knob for mixed loads: one request's prefill chunk is at most this many tokens a
    # step, so a long prompt leaves budget for short ones that arrive meanwhile (None: off)
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                "long_prefill_token_threshold must be >= 1 (or None), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how many blocks (or how many bytes) it gets."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one model replica) needs."""

    model: str | None = None  # None: the built-in SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None  # None: the model's context window
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica server: its engine, its name on the API and its HTTP limits."""

    engine: EngineConfig = EngineConfig()
    served_model_name: str | None = None  # None: derived from the model path
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1  # sent with 503s

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


ISOLATION_MODES = ("per-key", "shared")


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway: where replicas are, where keys live, and the admission bounds.

    ``max_inflight_per_replica`` requests are forwarded to each replica at once; beyond
    that they wait in the gateway's queue (fair across keys) for ``queue_timeout_s``, and
    past ``max_queued_requests`` waiting a request is refused at once (503 + Retry-After).
    ``default_reserve_tokens`` is what a request without ``max_tokens`` reserves against
    its key's tokens-per-minute limit until its real usage is known.
    """

    replicas: tuple[str, ...] = ()
    data_dir: str | None = None  # None: sendpath.gateway.keys.default_data_dir()
    require_keys: bool = True
    redis_url: str | None = None
    safety_rules: str | None = None  # None: the rules file that ships with sendpath
    safety: bool = True
    prefix_cache_isolation: str = "per-key"
    max_inflight_per_replica: int = 64
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    default_reserve_tokens: int = 1024
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1
    upstream_timeout_s: float = 600.0
    policy: str = "prefix_aware"  # routing: round_robin, least_load or prefix_aware
    retry_deadline_s: float = 30.0  # retries (before the first byte) stop after this
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prefix_cache_isolation not in ISOLATION_MODES:
            raise ValueError(
                f"prefix_cache_isolation must be one of {ISOLATION_MODES}, "
                f"got {self.prefix_cache_isolation!r}"
            )
        for name in ("max_inflight_per_replica", "default_reserve_tokens", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in ("queue_timeout_s", "upstream_timeout_s", "retry_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
