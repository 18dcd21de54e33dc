"""Component configs: one small dataclass each, validated when built."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

from sendpath.speculative_config import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "ConnectionLimits",
    "EngineConfig",
    "GatewayConfig",
    "KVEventsConfig",
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


CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how many blocks (or how many bytes) it gets."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    # auto: the model's dtype; int8: a scale per token and kv head (half bfloat16's bytes)
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"kv cache dtype {self.cache_dtype!r} is not offered; use one of "
                f"{', '.join(CACHE_DTYPES)} (int8: codes and a scale per token and kv head; an "
                "fp8 cache, without scales, moved the built-in model's likelihood of a text "
                "twice as much as int8 did)"
            )
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
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding


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
class KVEventsConfig:
    """Publishing the prefix cache's events (``server/kv_events.py``), with vLLM's keys and
    defaults (``--kv-events-config``): ZMQ PUB on ``endpoint``, missed batches replayed by
    sequence number on ``replay_endpoint`` (ROUTER) from the last ``buffer_steps`` steps.

    An endpoint whose host is ``*``, ``::``, a loopback address, or an ``ipc://`` /
    ``inproc://`` path is bound, so subscribers connect to it; any other host is connected
    to (vLLM's rule, "bind stable, connect volatile", with loopback added: on one machine
    the replica is the stable side).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            chosen = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", chosen)
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"{name} must be a ZMQ address (tcp://HOST:PORT, ipc://PATH or "
                    f"inproc://NAME), got {value!r}"
                )

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The config a ``--kv-events-config`` JSON object gives (vLLM's keys); raises
        ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError:
            raise ValueError(
                'give a JSON object, e.g. \'{"enable_kv_cache_events": true, '
                '"endpoint": "tcp://127.0.0.1:5557"}\''
            ) from None
        if not isinstance(raw, dict):
            raise ValueError("give a JSON object of vLLM's KVEventsConfig keys")
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(raw) - set(known)):
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        for key, value in raw.items():
            want: tuple[type, ...] = {
                "enable_kv_cache_events": (bool,),
                "buffer_steps": (int,),
                "hwm": (int,),
                "max_queue_size": (int,),
            }.get(key, (str, type(None)) if key in ("publisher", "replay_endpoint") else (str,))
            if not isinstance(value, want) or (bool not in want and isinstance(value, bool)):
                raise ValueError(f"{key} must be {' or '.join(t.__name__ for t in want)}")
        return cls(**raw)

    def for_replica(self, index: int) -> KVEventsConfig:
        """This config for the ``index``-th of several local replicas: TCP ports offset by
        ``index`` (vLLM's rule for its data-parallel ranks), a ``*`` port left to the OS."""

        def offset(endpoint: str | None) -> str | None:
            if endpoint is None or not endpoint.startswith("tcp://") or index == 0:
                return endpoint
            base, _, port = endpoint.rpartition(":")
            return f"{base}:{int(port) + index}" if port.isdigit() else endpoint

        endpoint = offset(self.endpoint)
        assert endpoint is not None
        return replace(self, endpoint=endpoint, replay_endpoint=offset(self.replay_endpoint))

    def on_node(self, host: str) -> KVEventsConfig:
        """This config for a replica a cluster engine placed on the node at ``host``: it
        binds ports the OS picks (several replicas may share a node), on loopback for a
        loopback node and on every interface otherwise (gateways on other nodes connect
        to the node's address, which the replica's URL gives)."""
        loopback = host == "localhost" or host.startswith("127.") or host == "::1"
        where = "127.0.0.1" if loopback else "*"
        again = f"tcp://{where}:*" if self.replay_endpoint is not None else None
        return replace(self, endpoint=f"tcp://{where}:*", replay_endpoint=again)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def publishes(self) -> bool:
        """Events leave the replica (enabled, over ZMQ)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


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
    kv_events: KVEventsConfig = KVEventsConfig()
    otlp_traces_endpoint: str | None = None  # spans' collector (also the OTEL_* environment)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.stuck_step_s > 0:
            raise ValueError(f"stuck_step_s must be > 0, got {self.stuck_step_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it out for no key)")


ISOLATION_MODES = ("per-key", "shared")
PREFIX_ROUTING = ("precise", "approximate")


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
    # prefix_aware on replicas that publish KV events: "precise" follows them (the
    # replicas' real caches), "approximate" keeps the gateway's own guess for every replica
    prefix_routing: str = "precise"
    retry_deadline_s: float = 30.0  # retries (before the first token) stop after this
    health_interval_s: float = 1.0
    replica_api_key: str | None = None
    replica_keys: tuple[str | None, ...] = ()
    connection: ConnectionLimits = ConnectionLimits()
    # a Ray cluster whose sendpath replicas join the pool as they come and go (`--ray`;
    # "auto": the one on this machine); they get ``replica_api_key``
    ray_address: str | None = None
    otlp_traces_endpoint: str | None = None  # spans' collector (also the OTEL_* environment)

    def __post_init__(self) -> None:
        if len(self.replica_keys) > len(self.replicas):
            raise ValueError("replica_keys has more keys than there are replicas")
        if self.prefix_routing not in PREFIX_ROUTING:
            raise ValueError(
                f"prefix_routing must be one of {PREFIX_ROUTING}, got {self.prefix_routing!r}"
            )
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
