"""The ``sendpath`` command: one entry point, one subcommand per face of the project."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sendpath import __version__
from sendpath.bench.command import add_bench_args, run_bench
from sendpath.chat import add_chat_args, run_chat
from sendpath.cluster.command import add_ray_gateway_arg, add_ray_serve_args, run_ray_serve
from sendpath.engine.args import MODEL_HELP, add_engine_args
from sendpath.errors import SendpathError
from sendpath.launch import add_gateway_args, run_gateway, run_serve
from sendpath.server.command import add_connection_args, add_kv_events_arg, run_replica
from sendpath.sim.command import add_sim_args, run_sim
from sendpath.sim.profile_command import DESCRIPTION as PROFILE_DESCRIPTION
from sendpath.sim.profile_command import add_profile_args, run_profile

if TYPE_CHECKING:
    pass

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
        help=MODEL_HELP,
    )
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
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
    add_engine_args(rep)
    add_kv_events_arg(rep, "")
    chat = sub.add_parser(
        "chat",
        help="send one message to a server, stream the answer, draw where the time went",
        description="Send one chat message to an OpenAI-compatible server (sendpath serve by "
        "default), stream the answer, then draw each stage of its path (network included).",
    )
    add_chat_args(chat)
    bench = sub.add_parser(
        "bench",
        help="load any OpenAI-compatible server and report like `vllm bench serve`",
        description="A load generator for any OpenAI-compatible server (sendpath, vLLM, "
        "llama.cpp): TTFT, TPOT, ITL, E2EL, throughput, goodput, and the stage breakdown "
        "when the server reports one. --scenario runs the seed's three situations.",
    )
    add_bench_args(bench)
    sim = sub.add_parser(
        "sim",
        help="simulate the serving stack on GPUs you do not have: latency, stages, cost",
        description="Run our scheduler, KV cache and router on a virtual clock with a "
        "roofline cost model, or with step times measured on this machine (--cost-model, "
        "from `sendpath profile`): the seed's scenarios (--scenario), or any traffic on any "
        "number of replicas. Reports what `sendpath bench` reports, plus utilisation and cost.",
    )
    add_sim_args(sim)
    prof = sub.add_parser(
        "profile",
        help="time the real engine's steps and fit a cost model for `sendpath sim --cost-model`",
        description=PROFILE_DESCRIPTION,
    )
    add_profile_args(prof)
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
    add_kv_events_arg(
        srv,
        "; each local replica gets its own ports (replica i: the ports + i; a '*' port: "
        "one the OS picks)",
    )
    add_ray_serve_args(srv)
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
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for several; or --ray)",
    )
    add_ray_gateway_arg(gw)
    gw.add_argument(
        "--workers", type=int, default=1, help="gateway processes on this port (use --redis)"
    )
    add_gateway_args(gw)
    keys = sub.add_parser(
        "keys",
        help="create, list, revoke API keys and show their usage",
        description="API keys for the gateway, stored hashed in SQLite under the data directory.",
    )
    data_help = "where keys live (default: $SENDPATH_DATA_DIR or ~/.local/share/sendpath)"
    keys.add_argument("--data-dir", type=Path, default=None, help=data_help)
    # the same flag after the action too (`keys create --name x --data-dir D`); SUPPRESS
    # keeps an action without it from overwriting the one given before the action
    data_dir = argparse.ArgumentParser(add_help=False)
    data_dir.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS, help=data_help)
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    kc = ksub.add_parser(
        "create", parents=[data_dir], help="create a key and print it once (its last output line)"
    )
    kc.add_argument("--name", required=True)
    kc.add_argument("--rpm", type=int, default=None, help="requests per minute (default: no limit)")
    kc.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: no limit)")
    kc.add_argument(
        "--daily-tokens", type=int, default=None, help="tokens per UTC day (default: no limit)"
    )
    kc.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the answer cap of this key's requests that set none (default: the gateway's "
        "--default-max-tokens)",
    )
    ksub.add_parser("list", parents=[data_dir], help="list keys (never their secrets)")
    kr = ksub.add_parser(
        "revoke", parents=[data_dir], help="revoke a key; takes effect on its next request"
    )
    kr.add_argument("name")
    ku = ksub.add_parser(
        "usage", parents=[data_dir], help="today's tokens and requests per key (UTC)"
    )
    ku.add_argument("name", nargs="?", default=None)
    return parser


def _keys(args: argparse.Namespace) -> int:
    from sendpath.gateway.keys import KeyStore, KeyStoreError, default_data_dir

    store = KeyStore(args.data_dir or default_data_dir())

    def limit(value: int | None) -> str:
        return "-" if value is None else str(value)

    try:
        if args.keys_command == "create":
            key, secret = store.create(
                args.name, args.rpm, args.tpm, args.daily_tokens, args.max_tokens
            )
            print(
                f"created key {key.name!r} (rpm {limit(key.rpm)}, tpm {limit(key.tpm)}, "
                f"daily tokens {limit(key.daily_tokens)}, default max tokens "
                f"{limit(key.max_tokens)}); it is shown once, keep it now:"
            )
            print(secret)
        elif args.keys_command == "list":
            print(
                f"{'NAME':<20} {'KEY':<12} {'RPM':>8} {'TPM':>10} {'DAILY':>12} "
                f"{'MAX TOKENS':>10}  STATUS"
            )
            for k in store.list():
                status = "active" if k.active else "revoked"
                print(
                    f"{k.name:<20} {k.hint + '...':<12} {limit(k.rpm):>8} {limit(k.tpm):>10} "
                    f"{limit(k.daily_tokens):>12} {limit(k.max_tokens):>10}  {status}"
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
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device)
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
            return run_replica(args)
        if args.command == "keys":
            return _keys(args)
        if args.command == "gateway":
            return run_gateway(args)
        if args.command == "serve":  # with --ray: on a Ray cluster
            return run_ray_serve(args) if args.ray is not None else run_serve(args)
        if args.command == "chat":
            return run_chat(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "sim":
            return run_sim(args)
        if args.command == "profile":
            return run_profile(args)
    except SendpathError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
