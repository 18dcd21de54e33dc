"""The ``sendpath`` command: one entry point, one subcommand per face of the project."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sendpath import __version__
from sendpath.errors import SendpathError

if TYPE_CHECKING:
    from sendpath.config import GatewayConfig

__all__ = ["build_parser", "main"]

DEFAULT_MESSAGE = "What happens after I press send on a chat message?"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(
        prog="sendpath",
        description="An LLM serving stack that shows what happens after a user presses send.",
    )
    parser.add_argument("--version", action="version", version=f"sendpath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the version and exit")
    gen = sub.add_parser(
        "generate",
        help="answer one message in this process (no server) and stream the answer",
        description="Load the model in this process, answer one message and stream the answer.",
    )
    gen.add_argument("message", nargs="?", default=DEFAULT_MESSAGE, help="the user message")
    gen.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF directory (default: built-in SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="a system message to put first")
    gen.add_argument(
        "--raw", action="store_true", help="complete the text as is, without the chat template"
    )
    rep = sub.add_parser(
        "replica",
        help="serve one model replica over an OpenAI-compatible HTTP API",
        description="Serve one model replica: /v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /load and /metrics.",
    )
    rep.add_argument("--host", default="127.0.0.1")
    rep.add_argument("--port", type=int, default=8001)
    add_engine_args(rep)
    srv = sub.add_parser(
        "serve",
        help="the whole stack: gateway + N local replicas on the built-in model (make serve)",
        description="Start N local replica processes (and/or use --replica URLs), wait until "
        "they are healthy, and serve the gateway in front of them. Ctrl-C or SIGTERM stops "
        "everything cleanly.",
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
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
    add_gateway_args(srv)
    add_engine_args(srv)
    gw = sub.add_parser(
        "gateway",
        help="the gateway alone, in front of replicas that already run (--replica URL)",
        description="API keys, rate limits, quotas, safety filter and admission in front of "
        "OpenAI-compatible replicas (ours, vLLM, llama.cpp).",
    )
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for several)",
    )
    gw.add_argument(
        "--workers", type=int, default=1, help="gateway processes on this port (use --redis)"
    )
    add_gateway_args(gw)
    keys = sub.add_parser(
        "keys",
        help="create, list, revoke API keys and show their usage",
        description="API keys for the gateway, stored hashed in SQLite under the data directory.",
    )
    keys.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where keys live (default: $SENDPATH_DATA_DIR or ~/.local/share/sendpath)",
    )
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    kc = ksub.add_parser("create", help="create a key and print it once (its last output line)")
    kc.add_argument("--name", required=True)
    kc.add_argument("--rpm", type=int, default=None, help="requests per minute (default: no limit)")
    kc.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: no limit)")
    kc.add_argument(
        "--daily-tokens", type=int, default=None, help="tokens per UTC day (default: no limit)"
    )
    ksub.add_parser("list", help="list keys (never their secrets)")
    kr = ksub.add_parser("revoke", help="revoke a key; takes effect on its next request")
    kr.add_argument("name")
    ku = ksub.add_parser("usage", help="today's tokens and requests per key (UTC)")
    ku.add_argument("name", nargs="?", default=None)
    return parser


# The replica's engine flags: (flag, argparse options). `serve` passes them on to replicas.
ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"help": "GGUF file or HF directory (default: built-in SmolLM2-135M-Instruct)"}),
    ("--served-model-name", {"help": "the model id clients send (default: from the path)"}),
    ("--dtype", {"default": "auto", "choices": ["auto", "float32", "bfloat16", "float16"]}),
    ("--device", {"help": "cpu or cuda (default: cuda if available)"}),
    ("--max-model-len", {"type": int, "help": "context window (default: the model's)"}),
    ("--max-num-seqs", {"type": int, "default": 64, "help": "most requests in one batch"}),
    (
        "--max-num-batched-tokens",
        {"type": int, "default": 512, "help": "token budget of one engine step"},
    ),
    ("--max-queued-requests", {"type": int, "help": "past this many waiting, answer 503"}),
    ("--block-size", {"type": int, "default": 16, "help": "KV cache block size in tokens"}),
    (
        "--kv-cache-memory-gib",
        {"type": float, "default": 1.0, "help": "memory for the KV cache"},
    ),
    ("--no-prefix-caching", {"action": "store_true", "help": "turn prefix caching off"}),
    (
        "--scheduling-policy",
        {"default": "fcfs", "choices": ["fcfs", "priority"], "help": "engine queue order"},
    ),
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for flag, options in ENGINE_FLAGS:
        p.add_argument(flag, **options)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as a replica command line (only those not at default)."""
    out: list[str] = []
    for flag, options in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None or value == options.get("default") or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


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
    p.add_argument("--no-auth", action="store_true", help="accept requests without an API key")
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="share rate limits across gateway processes (default: in this process)",
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
        "--default-reserve-tokens",
        type=int,
        default=1024,
        help="tokens a request without max_tokens reserves against its key's TPM",
    )


def gateway_config(args: argparse.Namespace, replicas: Sequence[str]) -> GatewayConfig:
    """The GatewayConfig the flags describe (raises ValueError on a bad value)."""
    from sendpath.config import GatewayConfig

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
        default_reserve_tokens=args.default_reserve_tokens,
        policy=args.policy,
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


def _gateway(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from sendpath.gateway.app import CONFIG_ENV, config_to_env, create_gateway_app
    from sendpath.gateway.safety import SafetyRulesError

    try:
        config = gateway_config(args, args.replica)
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        app = create_gateway_app(config)  # also checks the rules file and the data dir
    except (ValueError, SafetyRulesError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    announce_first_key(config)
    print(
        f"sendpath gateway: http://{args.host}:{args.port} -> {', '.join(config.replicas)} "
        f"({args.workers} worker{'s' if args.workers > 1 else ''})",
        flush=True,
    )
    _log_setup()
    if args.workers == 1:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
        return 0
    os.environ[CONFIG_ENV] = config_to_env(config)
    uvicorn.run(
        "sendpath.gateway.app:app_from_env",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
    )
    return 0


def _log_setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from sendpath.fleet import LocalFleet, ReplicaStartError
    from sendpath.gateway.app import create_gateway_app
    from sendpath.gateway.safety import SafetyRulesError

    if args.replicas < 1 and not args.replica:
        print(
            "error: nothing to serve: use --replicas N (N >= 1) or --replica URL", file=sys.stderr
        )
        return 2
    if args.model is not None and not Path(args.model).expanduser().exists():
        print(f"error: model path {args.model!r} does not exist.", file=sys.stderr)
        return 2
    _log_setup()
    try:
        fleet = LocalFleet(args.replicas, engine_argv(args))
        gateway_config(args, ["http://placeholder"])  # check the flags before starting anything
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with fleet:
        print(f"sendpath serve: starting {args.replicas} replica(s)...", flush=True)
        try:
            fleet.wait_healthy(args.startup_timeout)
            config = gateway_config(args, [*fleet.urls, *args.replica])
            app = create_gateway_app(config)
        except (ReplicaStartError, ValueError, SafetyRulesError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        announce_first_key(config)
        print(
            f"sendpath serve: http://{args.host}:{args.port}/v1 -> "
            f"{len(config.replicas)} replica(s), policy {config.policy} "
            "(Ctrl-C stops everything)",
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    print("sendpath serve: stopped", flush=True)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from sendpath.gateway.keys import KeyStore, KeyStoreError, default_data_dir

    store = KeyStore(args.data_dir or default_data_dir())

    def limit(value: int | None) -> str:
        return "-" if value is None else str(value)

    try:
        if args.keys_command == "create":
            key, secret = store.create(args.name, args.rpm, args.tpm, args.daily_tokens)
            print(
                f"created key {key.name!r} (rpm {limit(key.rpm)}, tpm {limit(key.tpm)}, "
                f"daily tokens {limit(key.daily_tokens)}); it is shown once, keep it now:"
            )
            print(secret)
        elif args.keys_command == "list":
            print(f"{'NAME':<20} {'KEY':<12} {'RPM':>8} {'TPM':>10} {'DAILY':>12}  STATUS")
            for k in store.list():
                status = "active" if k.active else "revoked"
                print(
                    f"{k.name:<20} {k.hint + '...':<12} {limit(k.rpm):>8} {limit(k.tpm):>10} "
                    f"{limit(k.daily_tokens):>12}  {status}"
                )
        elif args.keys_command == "revoke":
            store.revoke(args.name)
            print(f"revoked key {args.name!r}")
        else:
            rows = store.usage(args.name)
            print(f"{'NAME':<20} {'TOKENS':>12} {'REQUESTS':>10}   (today, UTC)")
            for name, (tokens, requests) in sorted(rows.items()):
                print(f"{name:<20} {tokens:>12} {requests:>10}")
    except KeyStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _replica(args: argparse.Namespace) -> int:
    import uvicorn

    from sendpath.config import CacheConfig, EngineConfig, ReplicaConfig, SchedulerConfig
    from sendpath.server.app import create_app, served_name

    try:
        config = ReplicaConfig(
            engine=EngineConfig(
                model=args.model,
                dtype=args.dtype,
                device=args.device,
                max_model_len=args.max_model_len,
                scheduler=SchedulerConfig(
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_queued_requests=args.max_queued_requests,
                    policy=args.scheduling_policy,
                ),
                cache=CacheConfig(
                    block_size=args.block_size,
                    kv_cache_memory_gib=args.kv_cache_memory_gib,
                    enable_prefix_caching=not args.no_prefix_caching,
                ),
            ),
            served_model_name=args.served_model_name,
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
        "(the model loads in the background; GET /health says when it is ready)",
        flush=True,
    )
    _log_setup()
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from sendpath.llm import LLM
    from sendpath.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if args.raw:
        print(args.message, end="", flush=True)
        print(llm.generate(args.message, params)[0].outputs[0].text)
        return 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    print(f"> {args.message}", flush=True)
    for delta in llm.stream_chat(messages, params):
        print(delta, end="", flush=True)
    print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "version":
            print(f"sendpath {__version__}")
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "replica":
            return _replica(args)
        if args.command == "keys":
            return _keys(args)
        if args.command == "gateway":
            return _gateway(args)
        if args.command == "serve":
            return _serve(args)
    except SendpathError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
