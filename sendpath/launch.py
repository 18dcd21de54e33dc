"""`sendpath serve` from the command line: its parser (``register``) and its run, the
gateway in front of local replica processes (``fleet.py``), which it owns and stops on
Ctrl-C or SIGTERM; with ``--ray``, replicas on a Ray cluster instead
(``cluster/command.py``). The gateway's own flags and config are ``gateway/command.py``;
`replica` alone is ``server/command.py``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from sendpath.api.cli_args import bound_socket, ignore, interrupt, log_setup
from sendpath.cluster.command import add_ray_serve_args, run_ray_serve
from sendpath.engine.args import add_engine_args, engine_argv
from sendpath.extras import require
from sendpath.gateway.command import (
    add_gateway_args,
    announce_first_key,
    gateway_config,
    replica_api_key,
)
from sendpath.server.command import add_kv_events_arg, kv_events_config

__all__ = ["register", "run_serve"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `serve` subcommand: its flags, and ``run_serve`` (``run_ray_serve`` with
    ``--ray``) as its handler."""
    srv = sub.add_parser(
        "serve",
        help=help,
        description="Start N local replica processes (and/or use --replica URLs), wait until "
        "they are healthy, and serve the gateway in front of them. Ctrl-C or SIGTERM stops "
        "everything cleanly.",
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument(
        "--port", type=int, default=8000, help="the gateway's (8000; 0 takes a free one)"
    )
    srv.add_argument("--replicas", type=int, default=1, help="local replica processes (1)")
    srv.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="also route to this OpenAI-compatible server (vLLM, llama.cpp; repeatable)",
    )
    srv.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for replicas"
    )
    add_kv_events_arg(
        srv,
        "; each local replica gets its own ports (replica i: the ports + i; a '*' port: "
        "one the OS picks)",
    )
    add_ray_serve_args(srv)
    add_gateway_args(srv)
    add_engine_args(srv)
    srv.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> int:
    """`serve`, locally or (``--ray``) on a Ray cluster."""
    return run_ray_serve(args) if args.ray is not None else run_serve(args)


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
    if args.otlp_traces_endpoint is not None:
        require("otel")
    log_setup()
    # only this gateway can use the local replicas: their key is given, or made here
    replica_key = replica_api_key(args) or secrets.token_urlsafe(32)
    try:
        events = kv_events_config(args)
        gateway_config(args, ["http://placeholder"])  # check the flags before starting anything
        argv = engine_argv(args)
        if args.otlp_traces_endpoint is not None:  # the replicas' spans go there too
            argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        fleet = LocalFleet(args.replicas, argv, replica_key, events)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sock = bound_socket(args)  # taken before the replicas start (minutes, maybe)
    if sock is None:
        return 1
    port = sock.getsockname()[1]
    # While replicas start, SIGTERM stops everything as Ctrl-C does. While serving, uvicorn
    # catches both, shuts down gracefully and then re-raises the signal: the handler below
    # swallows it, so the replicas are stopped here instead of the process dying mid-way.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        with sock, fleet:
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
                    f"sendpath serve: http://{args.host}:{port}/v1 -> "
                    f"{len(config.replicas)} replica(s), policy {config.policy} "
                    "(Ctrl-C stops everything)",
                    flush=True,
                )

            settle_heap()  # before Ctrl-C is uvicorn's: a press meanwhile stops the start
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, ignore)
            fleet.supervise()  # a replica that exits is started again
            http_server.run(app, sock, config.connection, listening)
    except KeyboardInterrupt:
        print("sendpath serve: interrupted while starting; replicas stopped", flush=True)
        return 130
    print("sendpath serve: stopped", flush=True)
    return 0
