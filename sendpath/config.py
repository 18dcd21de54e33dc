"""Component configs: one small dataclass each, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CacheConfig",
    "ConnectionLimits",
    "EngineConfig",
    "GatewayConfig",
    "ReplicaConfig",
    "SchedulerConfig",
]


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
    quantization: str = "auto"  # auto, none, int8, int4 (vLLM's name)
    device: str | None = None
    max_model_len: int | None = None  # None: the model's context window
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()


@dataclass(frozen=True)
class ConnectionLimits:
    """How long an HTTP client may take (seconds), for the gateway and the replica alike:
    to send its whole request, to read what is sent to it (a stalled reader is dropped,
    which aborts its request), and to stay idle between requests on a kept-alive
    connection. ``send_buffer_bytes`` bounds what may wait unread in the kernel (and again
    in the process) before a reader counts as stalled."""

    request_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    send_buffer_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "write_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.send_buffer_bytes < 4096:
            raise ValueError(f"send_buffer_bytes must be >= 4096, got {self.send_buffer_bytes}")


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica server: its engine, its name on the API and its HTTP limits.

    ``api_key``: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need it as a bearer
    token (vLLM's ``--api-key``); ``sendpath serve`` gives its local replicas one.
    ``stuck_step_s``: an engine step running longer than this means the engine is stuck
    (a hung device, a deadlock): the replica says so on ``/health`` and ``/ready`` and exits.
    """

    engine: EngineConfig = EngineConfig()
    served_model_name: str | None = None  # None: derived from the model path
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1  # sent with 503s
    api_key: str | None = None
    connection: ConnectionLimits = ConnectionLimits()
    stuck_step_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.stuck_step_s > 0:
            raise ValueError(f"stuck_step_s must be > 0, got {self.stuck_step_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it out for no key)")


ISOLATION_MODES = ("per-key", "shared")


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway: where replicas are, where keys live, the admission bounds and timeouts.

    ``max_inflight_per_replica`` requests are forwarded to each replica at once; beyond
    that they wait in the gateway's queue (fair across keys) for ``queue_timeout_s``, and
    past ``max_queued_requests`` waiting a request is refused at once (503 + Retry-After).
    ``default_max_tokens`` caps the answer of a request that sets no cap (a key's own
    ``max_tokens`` comes first); it is reserved against the key's limits and sent upstream.
    ``redis_fail_open``: when Redis does not answer, limit per process (True) or refuse
    with 503 (False). The timeouts towards replicas are in seconds: connecting, a stream's
    first token, the gap between tokens, and a whole non-streamed answer.
    ``replica_api_key`` is sent to replicas as a bearer token (their ``--api-key``);
    ``replica_keys``, when given, is each replica's own key instead, in ``replicas`` order
    (`serve` gives its local replicas one key and any others theirs).
    """

    replicas: tuple[str, ...] = ()
    data_dir: str | None = None  # None: sendpath.gateway.keys.default_data_dir()
    require_keys: bool = True
    redis_url: str | None = None
    redis_fail_open: bool = True
    safety_rules: str | None = None  # None: the rules file that ships with sendpath
    safety: bool = True
    prefix_cache_isolation: str = "per-key"
    max_inflight_per_replica: int = 64
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    default_max_tokens: int = 1024
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 120.0
    between_tokens_timeout_s: float = 60.0
    upstream_timeout_s: float = 600.0
    policy: str = "prefix_aware"  # routing: round_robin, least_load or prefix_aware
    retry_deadline_s: float = 30.0  # retries (before the first token) stop after this
    health_interval_s: float = 1.0
    replica_api_key: str | None = None
    replica_keys: tuple[str | None, ...] = ()
    connection: ConnectionLimits = ConnectionLimits()

    def __post_init__(self) -> None:
        if len(self.replica_keys) > len(self.replicas):
            raise ValueError("replica_keys has more keys than there are replicas")
        if self.prefix_cache_isolation not in ISOLATION_MODES:
            raise ValueError(
                f"prefix_cache_isolation must be one of {ISOLATION_MODES}, "
                f"got {self.prefix_cache_isolation!r}"
            )
        for name in ("max_inflight_per_replica", "default_max_tokens", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in (
            "queue_timeout_s",
            "connect_timeout_s",
            "first_token_timeout_s",
            "between_tokens_timeout_s",
            "upstream_timeout_s",
            "retry_deadline_s",
            "health_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    def keys_by_replica(self) -> tuple[str | None, ...]:
        """The key each replica gets, in ``replicas`` order."""
        if self.replica_keys:
            return self.replica_keys
        return (self.replica_api_key,) * len(self.replicas)
