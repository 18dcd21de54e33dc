"""`sendpath gateway` from the command line: its parser (``register``), the gateway's flags
(shared with `serve`), the ``GatewayConfig`` they make, and its run (uvicorn, one or
several worker processes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sendpath.api.cli_args import (
    add_connection_args,
    add_tracing_args,
    bound_socket,
    connection_limits,
    log_setup,
)
from sendpath.config import GatewayConfig
from sendpath.extras import require
from sendpath.telemetry.export import traces_endpoint

DEFAULTS = GatewayConfig()  # every flag's default is the config's own (one place for each)

__all__ = [
    "add_gateway_args",
    "announce_first_key",
    "gateway_config",
    "register",
    "replica_api_key",
    "run_gateway",
]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `gateway` subcommand: its flags, and ``run_gateway`` as its handler."""
    gw = sub.add_parser(
        "gateway",
        help=help,
        description="API keys, rate limits, quotas, safety filter and admission in front of "
        "OpenAI-compatible replicas (ours, vLLM, llama.cpp).",
    )
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000, help="8000; 0 takes a free one (--workers 1)")
    gw.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for several; or --ray)",
    )
    gw.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="route to the sendpath replicas of this Ray cluster (host:port of its head; "
        "auto: the one running on this machine) as they come and go; needs the ray extra: "
        "pip install 'sendpath[ray]'",
    )
    gw.add_argument(
        "--workers", type=int, default=1, help="gateway processes on this port (use --redis)"
    )
    add_gateway_args(gw)
    gw.set_defaults(handler=run_gateway)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The gateway's flags (shared by `gateway` and `serve`)."""
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keys and usage (default: $SENDPATH_DATA_DIR or ~/.local/share/sendpath)",
    )
    p.add_argument(
        "--policy",
        default=DEFAULTS.policy,
        choices=["prefix_aware", "least_load", "round_robin"],
        help="how the router picks a replica (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-routing",
        default=DEFAULTS.prefix_routing,
        choices=["precise", "approximate"],
        help="prefix_aware on replicas that publish KV events (--kv-events-config): "
        "precise follows their events and routes on what each really holds, so several "
        "gateways agree; approximate guesses from the prompts sent (default: %(default)s; "
        "replicas without events are always approximate)",
    )
    p.add_argument("--no-auth", action="store_true", help="accept requests without an API key")
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="share rate limits across gateway processes (default: in this process); "
        "needs the redis extra: pip install 'sendpath[redis]'",
    )
    p.add_argument(
        "--replica-api-key",
        default=None,
        metavar="KEY",
        help="sent to replicas as 'Authorization: Bearer KEY' (their --api-key; also read "
        "from $SENDPATH_REPLICA_API_KEY). `serve` gives its local replicas this key, or one "
        "it generates",
    )
    p.add_argument(
        "--redis-failure",
        default="open" if DEFAULTS.redis_fail_open else "closed",
        choices=["open", "closed"],
        help="when Redis does not answer: limit per process (open) or refuse requests with "
        "503 (closed; default: %(default)s)",
    )
    p.add_argument(
        "--safety-rules", default=None, metavar="FILE", help="TOML [categories] of regexes"
    )
    p.add_argument("--no-safety", action="store_true", help="turn the safety filter off")
    p.add_argument(
        "--prefix-cache-isolation",
        default=DEFAULTS.prefix_cache_isolation,
        choices=["per-key", "shared"],
        help="per-key: a tenant's cached prefixes are invisible to others (default: %(default)s)",
    )
    p.add_argument(
        "--max-inflight-per-replica",
        type=int,
        default=DEFAULTS.max_inflight_per_replica,
        help="requests forwarded to each replica at once; beyond this, they queue (%(default)s)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULTS.max_queued_requests,
        help="gateway queue: past this many waiting, 503 (%(default)s)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=DEFAULTS.queue_timeout_s,
        help="seconds a request may wait, then 503 (%(default)g)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULTS.default_max_tokens,
        help="the answer cap of a request that sets none (a key's own --max-tokens comes "
        "first); reserved against the key's limits and sent to the replica (%(default)s)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=DEFAULTS.connect_timeout_s, metavar="S",
        help="seconds to connect to a replica before trying another (%(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--first-token-timeout", type=float, default=DEFAULTS.first_token_timeout_s,
        metavar="S",
        help="seconds a replica may take to a stream's first token; then it counts as "
        f"failed and the request gets 504, or another replica while the "
        f"{DEFAULTS.retry_deadline_s:g} s retry window is open (%(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--between-tokens-timeout", type=float, default=DEFAULTS.between_tokens_timeout_s,
        metavar="S",
        help="seconds a replica may send nothing mid-stream before the stream ends with an "
        "error (%(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--upstream-timeout", type=float, default=DEFAULTS.upstream_timeout_s, metavar="S",
        help="seconds a replica may take to a whole non-streamed answer (%(default)g)",
    )  # fmt: skip
    add_connection_args(p)
    add_tracing_args(p)


def replica_api_key(args: argparse.Namespace) -> str | None:
    """The key replicas want, from the flag or the environment."""
    import os

    key: str | None = args.replica_api_key or os.environ.get("SENDPATH_REPLICA_API_KEY")
    return key or None


def gateway_config(
    args: argparse.Namespace, replicas: Sequence[str], local: Sequence[str] = (), key: str = ""
) -> GatewayConfig:
    """The GatewayConfig the flags describe (raises ValueError on a bad value). ``local``:
    the replicas `serve` started, first in ``replicas``, whose key is ``key``; the others
    get --replica-api-key, if any (a generated key never leaves this host's replicas)."""
    outside = replica_api_key(args)
    keys = (key,) * len(local) + (outside,) * (len(replicas) - len(local)) if local else ()
    return GatewayConfig(
        replicas=tuple(replicas),
        data_dir=str(args.data_dir) if args.data_dir else None,
        require_keys=not args.no_auth,
        redis_url=args.redis,
        safety_rules=args.safety_rules,
        safety=not args.no_safety,
        prefix_cache_isolation=args.prefix_cache_isolation,
        max_inflight_per_replica=args.max_inflight_per_replica,
        max_queued_requests=args.queue_size,
        queue_timeout_s=args.queue_timeout,
        default_max_tokens=args.default_max_tokens,
        policy=args.policy,
        prefix_routing=args.prefix_routing,
        redis_fail_open=args.redis_failure == "open",
        connect_timeout_s=args.connect_timeout,
        first_token_timeout_s=args.first_token_timeout,
        between_tokens_timeout_s=args.between_tokens_timeout,
        upstream_timeout_s=args.upstream_timeout,
        replica_api_key=outside,
        replica_keys=keys,
        connection=connection_limits(args),
        otlp_traces_endpoint=traces_endpoint(args.otlp_traces_endpoint),
    )


def announce_first_key(config: GatewayConfig) -> None:
    """With keys required and none yet, create key 'default' and print it once."""
    from sendpath.gateway.app import ensure_first_key, key_store

    if not config.require_keys:
        return
    store = key_store(config)
    secret = ensure_first_key(store)
    if secret is not None:
        print(
            f"no API keys in {store.path.parent} yet: created key 'default' (no limits). It is "
            "shown once; clients send it as 'Authorization: Bearer <key>':",
            flush=True,
        )
        print(secret, flush=True)


def run_gateway(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from sendpath.api import http_server
    from sendpath.gateway.app import (
        CONFIG_ENV,
        config_to_env,
        create_gateway_app,
        settle_heap,
    )
    from sendpath.gateway.safety import SafetyRulesError

    if args.redis:
        require("redis")
    if args.otlp_traces_endpoint is not None:
        require("otel")
    if args.ray is not None:
        require("ray")
    elif not args.replica:
        print("error: give the replicas: --replica URL (repeatable) or --ray ADDRESS",
              file=sys.stderr)  # fmt: skip
        return 2
    log_setup()  # before the app: what it builds says how (the span export's path)
    try:
        config = replace(gateway_config(args, args.replica), ray_address=args.ray)
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        app = create_gateway_app(config)  # also checks the rules file and the data dir
    except (ValueError, SafetyRulesError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    announce_first_key(config)
    behind = ", ".join(config.replicas) or "the Ray cluster's sendpath replicas"
    if config.ray_address is not None and config.replicas:
        behind += " and the Ray cluster's sendpath replicas"
    sock = None  # several workers: uvicorn's master binds the port
    if args.workers == 1 and (sock := bound_socket(args)) is None:
        return 1
    port = args.port if sock is None else sock.getsockname()[1]
    print(
        f"sendpath gateway: http://{args.host}:{port} -> {behind} "
        f"({args.workers} worker{'s' if args.workers > 1 else ''})",
        flush=True,
    )
    if sock is not None:
        settle_heap()
        with sock:
            http_server.run(app, sock, config.connection)
        return 0
    os.environ[CONFIG_ENV] = config_to_env(config)
    uvicorn.run(
        "sendpath.gateway.app:app_from_env",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
        http=http_server.GuardedProtocol,
        timeout_keep_alive=max(1, round(config.connection.keep_alive_s)),
    )
    return 0
