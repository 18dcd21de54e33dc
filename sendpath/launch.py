"""Starting the gateway from the command line: `gateway`, and `serve` (the gateway with
local replicas; `replica` alone is ``server/command.py``).

`cli.py` parses; this module turns the flags into configs, prints what a person needs (the
URL, the first API key) and runs uvicorn. `serve` also owns the local replica processes and
stops them on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from sendpath.config import GatewayConfig
from sendpath.engine.args import engine_argv
from sendpath.extras import require
from sendpath.server.command import (
    add_connection_args,
    connection_limits,
    kv_events_config,
    log_setup,
)

__all__ = ["add_gateway_args", "gateway_config", "run_gateway", "run_serve"]


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
        default="prefix_aware",
        choices=["prefix_aware", "least_load", "round_robin"],
        help="how the router picks a replica (default: prefix_aware)",
    )
    p.add_argument(
        "--prefix-routing",
        default="precise",
        choices=["precise", "approximate"],
        help="prefix_aware on replicas that publish KV events (--kv-events-config): "
        "precise follows their events and routes on what each really holds, so several "
        "gateways agree; approximate guesses from the prompts sent (default: precise; "
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
        default="open",
        choices=["open", "closed"],
        help="when Redis does not answer: limit per process (open, default) or refuse "
        "requests with 503 (closed)",
    )
    p.add_argument(
        "--safety-rules", default=None, metavar="FILE", help="TOML [categories] of regexes"
    )
    p.add_argument("--no-safety", action="store_true", help="turn the safety filter off")
    p.add_argument(
        "--prefix-cache-isolation",
        default="per-key",
        choices=["per-key", "shared"],
        help="per-key: a tenant's cached prefixes are invisible to others (default)",
    )
    p.add_argument(
        "--max-inflight-per-replica", type=int, default=64, help="beyond this, requests queue"
    )
    p.add_argument(
        "--queue-size", type=int, default=1024, help="gateway queue: past this many waiting, 503"
    )
    p.add_argument(
        "--queue-timeout", type=float, default=30.0, help="seconds a request may wait, then 503"
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="the answer cap of a request that sets none (a key's own --max-tokens comes "
        "first); reserved against the key's limits and sent to the replica (1024)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=5.0, metavar="S",
        help="seconds to connect to a replica before trying another (5)",
    )  # fmt: skip
    p.add_argument(
        "--first-token-timeout", type=float, default=120.0, metavar="S",
        help="seconds a replica may take to a stream's first token; then it counts as "
        "failed and the request gets 504, or another replica while the 30 s retry window "
        "is open (120)",
    )  # fmt: skip
    p.add_argument(
        "--between-tokens-timeout", type=float, default=60.0, metavar="S",
        help="seconds a replica may send nothing mid-stream before the stream ends with an "
        "error (60)",
    )  # fmt: skip
    p.add_argument(
        "--upstream-timeout", type=float, default=600.0, metavar="S",
        help="seconds a replica may take to a whole non-streamed answer (600)",
    )  # fmt: skip
    add_connection_args(p)


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
    if args.ray is not None:
        require("ray")
    elif not args.replica:
        print("error: give the replicas: --replica URL (repeatable) or --ray ADDRESS",
              file=sys.stderr)  # fmt: skip
        return 2
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
    print(
        f"sendpath gateway: http://{args.host}:{args.port} -> {behind} "
        f"({args.workers} worker{'s' if args.workers > 1 else ''})",
        flush=True,
    )
    log_setup()
    if args.workers == 1:
        settle_heap()
        http_server.run(app, args.host, args.port, config.connection)
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


def run_serve(args: argparse.Namespace) -> int:
    import secrets

    from sendpath.api import http_server
    from sendpath.fleet import LocalFleet, ReplicaStartError
    from sendpath.gateway.app import create_gateway_app, settle_heap
    from sendpath.gateway.safety import SafetyRulesError

    for flag in ("min_replicas", "max_replicas", "ray_autoscaling_config"):
        if getattr(args, flag) is not None:
            print(f"error: --{flag.replace('_', '-')} needs --ray (Ray Serve scales the "
                  "replicas)", file=sys.stderr)  # fmt: skip
            return 2
    if args.replicas < 1 and not args.replica:
        print(
            "error: nothing to serve: use --replicas N (N >= 1) or --replica URL", file=sys.stderr
        )
        return 2
    if args.model is not None and not Path(args.model).expanduser().exists():
        print(f"error: model path {args.model!r} does not exist.", file=sys.stderr)
        return 2
    if args.redis:
        require("redis")
    log_setup()
    # only this gateway can use the local replicas: their key is given, or made here
    replica_key = replica_api_key(args) or secrets.token_urlsafe(32)
    try:
        events = kv_events_config(args)
        fleet = LocalFleet(args.replicas, engine_argv(args), replica_key, events)
        gateway_config(args, ["http://placeholder"])  # check the flags before starting anything
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # While replicas start, SIGTERM stops everything as Ctrl-C does. While serving, uvicorn
    # catches both, shuts down gracefully and then re-raises the signal: the handler below
    # swallows it, so the replicas are stopped here instead of the process dying mid-way.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with fleet:
            print(f"sendpath serve: starting {args.replicas} replica(s)...", flush=True)
            try:
                fleet.wait_healthy(args.startup_timeout)
                urls = [*fleet.urls, *args.replica]
                config = gateway_config(args, urls, fleet.urls, replica_key)
                app = create_gateway_app(config, fleet_status=fleet.status)
            except (ReplicaStartError, ValueError, SafetyRulesError, OSError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            announce_first_key(config)

            def listening() -> None:
                print(
                    f"sendpath serve: http://{args.host}:{args.port}/v1 -> "
                    f"{len(config.replicas)} replica(s), policy {config.policy} "
                    "(Ctrl-C stops everything)",
                    flush=True,
                )

            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _ignore)
            fleet.supervise()  # a replica that exits is started again
            settle_heap()
            http_server.run(app, args.host, args.port, config.connection, listening)
    except KeyboardInterrupt:
        print("sendpath serve: interrupted while starting; replicas stopped", flush=True)
        return 130
    print("sendpath serve: stopped", flush=True)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass
