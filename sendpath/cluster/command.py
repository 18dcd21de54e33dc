"""`sendpath serve --ray`: its flags and its run (`gateway --ray` is the gateway's own
flag, ``gateway/command.py``).

`serve --ray ADDRESS` deploys the replicas on the Ray cluster (``fleet.py``) and serves the
gateway in front of them in this process; `gateway --ray ADDRESS` is one more gateway (on
another node, say) in front of the replicas a `serve --ray` deployed: both follow the
cluster's directory, so replicas that come, move or go are routed to, or forgotten, at
once.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["add_ray_serve_args", "run_ray_serve"]


def _json_object(text: str) -> dict[str, Any]:
    try:
        found = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            "give a JSON object of Serve AutoscalingConfig keys, e.g. '{\"downscale_delay_s\": 60}'"
        ) from None
    if not isinstance(found, dict):
        raise argparse.ArgumentTypeError("give a JSON object of Serve AutoscalingConfig keys")
    return found


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s Ray flags (placement and scaling of the replicas it deploys)."""
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the replicas as a Ray Serve deployment on this Ray cluster (host:port of "
        "its head), or auto: the cluster running on this machine, else a new local Ray "
        "instance; Ray places, restarts and scales them, --replicas is how many to start. "
        "Needs the ray extra: pip install 'sendpath[ray]'",
    )
    p.add_argument(
        "--replica-num-cpus", type=float, default=1.0, metavar="N",
        help="with --ray: CPUs each replica asks Ray for (1; its torch threads)",
    )  # fmt: skip
    p.add_argument(
        "--replica-num-gpus", type=float, default=0.0, metavar="N",
        help="with --ray: GPUs each replica asks Ray for (0; 1 runs it on a GPU)",
    )  # fmt: skip
    p.add_argument(
        "--min-replicas", type=int, default=None, metavar="N",
        help="with --ray and --max-replicas: the fewest replicas the autoscaler keeps (1)",
    )  # fmt: skip
    p.add_argument(
        "--max-replicas", type=int, default=None, metavar="N",
        help="with --ray: autoscale up to N replicas on the requests held, running and "
        "waiting in the replicas' engines plus waiting in the gateways' queues",
    )  # fmt: skip
    p.add_argument(
        "--target-ongoing-requests", type=float, default=8.0, metavar="N",
        help="with --max-replicas: the requests per replica the autoscaler aims at (8)",
    )  # fmt: skip
    p.add_argument(
        "--ray-autoscaling-config", type=_json_object, default=None, metavar="JSON",
        help="with --max-replicas: more of Serve's AutoscalingConfig keys, e.g. "
        '\'{"upscale_delay_s": 5, "downscale_delay_s": 120, "look_back_period_s": 10}\'',
    )  # fmt: skip


def run_ray_serve(args: argparse.Namespace) -> int:
    """`serve --ray`: deploy, serve the gateway until Ctrl-C or SIGTERM, delete."""
    from sendpath.api import http_server
    from sendpath.api.cli_args import (
        bound_socket,
        connection_limits,
        ignore,
        interrupt,
        log_setup,
    )
    from sendpath.cluster.fleet import RayFleet, RayPlacement, RayScaling, connect
    from sendpath.config import ReplicaConfig
    from sendpath.engine.args import engine_config
    from sendpath.extras import require
    from sendpath.gateway.app import create_gateway_app, settle_heap
    from sendpath.gateway.command import announce_first_key, gateway_config
    from sendpath.gateway.command import replica_api_key as given_key
    from sendpath.gateway.safety import SafetyRulesError
    from sendpath.server.command import kv_events_config
    from sendpath.telemetry.export import traces_endpoint

    require("ray")
    if args.redis:
        require("redis")
    if args.model is not None and not Path(args.model).expanduser().resolve().exists():
        print(f"error: model path {args.model!r} does not exist.", file=sys.stderr)
        return 2
    # only this cluster's gateways can use its replicas: the key is given, or made here
    key = given_key(args) or secrets.token_urlsafe(32)
    try:
        engine = engine_config(args)
        if engine.model is not None:  # every node reads the same path
            engine = replace(engine, model=str(Path(engine.model).expanduser().resolve()))
        replica = ReplicaConfig(
            engine=engine,
            served_model_name=args.served_model_name,
            api_key=key,
            connection=connection_limits(args),
            stuck_step_s=args.stuck_step_timeout,
            kv_events=kv_events_config(args),
            # each replica, on whatever node, sends its spans to the same collector
            otlp_traces_endpoint=traces_endpoint(args.otlp_traces_endpoint),
        )
        scaling = RayScaling(
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            options=args.ray_autoscaling_config or {},
        )
        fleet = RayFleet(
            replica, RayPlacement(args.replica_num_cpus, args.replica_num_gpus), scaling
        )
        config = gateway_config(args, args.replica)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = replace(config, ray_address=args.ray, replica_api_key=key)
    sock = bound_socket(args)  # taken before the replicas deploy (minutes, maybe)
    if sock is None:
        return 1
    port = sock.getsockname()[1]
    log_setup()
    signal.signal(signal.SIGTERM, interrupt)
    try:
        print(f"sendpath serve: {connect(args.ray)}", flush=True)
        try:
            how = (
                f"autoscaling {scaling.initial} -> [{args.min_replicas or 1}, "
                f"{args.max_replicas}] on {args.target_ongoing_requests:g} requests each"
                if scaling.autoscales
                else f"{scaling.replicas}"
            )
            print(f"sendpath serve: deploying replicas on Ray Serve ({how})...", flush=True)
            fleet.start(args.startup_timeout)
            app = create_gateway_app(config)
        except (RuntimeError, ValueError, SafetyRulesError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        announce_first_key(config)
        if given_key(args) is None:
            print(
                "sendpath serve: the replicas' key was generated here; for more gateways "
                "(sendpath gateway --ray), start this with --replica-api-key",
                flush=True,
            )

        def listening() -> None:
            print(
                f"sendpath serve: http://{args.host}:{port}/v1 -> Ray Serve app "
                f"'sendpath', policy {config.policy} (Ctrl-C stops everything)",
                flush=True,
            )

        settle_heap()  # before Ctrl-C is uvicorn's: a press meanwhile stops the start
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, ignore)
        http_server.run(app, sock, config.connection, listening)
    except KeyboardInterrupt:
        print("sendpath serve: interrupted while starting", flush=True)
        return 130
    finally:
        sock.close()
        fleet.close()
    print("sendpath serve: stopped (the Serve app is deleted)", flush=True)
    return 0
