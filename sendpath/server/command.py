"""`sendpath replica` from the command line: its parser (``register``) and its run.

The connection limits are every server command's (``api/cli_args.py``); the KV
events flag is the replica's (``--kv-events-config``, with vLLM's keys; `serve` passes it
on to its local replicas). ``run_replica`` turns the flags into a ``ReplicaConfig`` and
serves it with uvicorn until stopped, or until its engine fails (then it exits 1, so
`serve` starts it again).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sendpath.api.cli_args import (
    add_connection_args,
    add_tracing_args,
    connection_limits,
    log_setup,
)
from sendpath.config import KVEventsConfig
from sendpath.engine.args import add_engine_args, engine_config
from sendpath.extras import require
from sendpath.telemetry.export import traces_endpoint

__all__ = ["API_KEY_ENV", "add_kv_events_arg", "kv_events_config", "register", "run_replica"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `replica` subcommand: its flags, and ``run_replica`` as its handler."""
    rep = sub.add_parser(
        "replica",
        help=help,
        description="Serve one model replica: /v1/chat/completions, /v1/completions, "
        "/v1/models, /tokenize, /detokenize, /health (alive), /ready (takes requests), "
        "/load and /metrics.",
    )
    rep.add_argument("--host", default="127.0.0.1")
    rep.add_argument("--port", type=int, default=8001)
    rep.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(also read from $SENDPATH_API_KEY; default: none)",
    )
    add_connection_args(rep)
    add_tracing_args(rep)
    add_engine_args(rep)
    add_kv_events_arg(rep, "")
    rep.set_defaults(handler=run_replica)


def _kv_events(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_kv_events_arg(p: argparse.ArgumentParser, more_help: str) -> None:
    p.add_argument(
        "--kv-events-config",
        type=_kv_events,
        default=None,
        metavar="JSON",
        help="publish the prefix cache's events over ZMQ as vLLM does, with vLLM's keys: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
        '"replay_endpoint": "tcp://127.0.0.1:5567", "topic": ""}\'; gateways subscribe and '
        f"route on what each replica holds (needs sendpath[kv-events]){more_help}",
    )


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig:
    """``--kv-events-config`` (off when not given); checks its extra is installed."""
    config: KVEventsConfig = args.kv_events_config or KVEventsConfig()
    if config.publishes:
        require("kv-events")
    if args.otlp_traces_endpoint is not None:
        require("otel")
    return config


API_KEY_ENV = "SENDPATH_API_KEY"  # a replica's key, from `serve` (not on its command line)
EXIT_GRACE_S = 15.0  # a replica whose engine failed drains this long at most, then exits


def run_replica(args: argparse.Namespace) -> int:
    import os
    import threading

    import uvicorn

    from sendpath.api.http_server import uvicorn_config
    from sendpath.config import ReplicaConfig
    from sendpath.server.app import create_app, served_name

    try:
        config = ReplicaConfig(
            engine=engine_config(args),
            served_model_name=args.served_model_name,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            connection=connection_limits(args),
            stuck_step_s=args.stuck_step_timeout,
            kv_events=kv_events_config(args),
            otlp_traces_endpoint=traces_endpoint(args.otlp_traces_endpoint),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model is not None and not Path(args.model).expanduser().exists():
        print(
            f"error: model path {args.model!r} does not exist; pass a .gguf file or a "
            "Hugging Face model directory.",
            file=sys.stderr,
        )
        return 2
    print(
        f"sendpath replica: serving {served_name(config)} on http://{args.host}:{args.port} "
        "(the model loads in the background; GET /ready says when it takes requests)",
        flush=True,
    )
    log_setup()
    failed: list[bool] = []
    server: list[uvicorn.Server] = []

    def stop() -> None:  # the engine stopped or is stuck: exit, so `serve` restarts it
        failed.append(True)
        server[0].should_exit = True
        # a stuck step never returns, nor do the requests waiting on it: exit regardless
        deadline = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
        deadline.daemon = True
        deadline.start()

    app = create_app(config, on_engine_failure=stop)
    server.append(uvicorn.Server(uvicorn_config(app, args.host, args.port, config.connection)))
    server[0].run()
    return 1 if failed else 0
