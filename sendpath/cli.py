"""The ``sendpath`` command: one entry point, one subcommand per face of the project.

Each command's module registers its own subparser and handler (``register(sub, help)``,
the handler as ``args.handler``) and imports what the command needs only when it runs.
``main`` builds only the subcommand it is given (the others are a name and a help line),
so `sendpath --version`, `sendpath --help` and `sendpath keys list` load neither torch nor
the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sendpath import __version__
from sendpath.errors import SendpathError

__all__ = ["COMMANDS", "build_parser", "main"]

DEFAULT_MESSAGE = "What happens after I press send on a chat message?"

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]", str], None]

# name -> (the module whose ``register`` adds it, or "" for one here; its help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "version": ("", "print the version and exit"),
    "generate": ("", "answer one message in this process (no server) and stream the answer"),
    "replica": (
        "sendpath.server.command",
        "serve one model replica over an OpenAI-compatible HTTP API",
    ),
    "chat": (
        "sendpath.chat",
        "send one message to a server, stream the answer, draw where the time went",
    ),
    "bench": (
        "sendpath.bench.command",
        "load any OpenAI-compatible server and report like `vllm bench serve`",
    ),
    "sim": (
        "sendpath.sim.command",
        "simulate the serving stack on GPUs you do not have: latency, stages, cost",
    ),
    "profile": (
        "sendpath.sim.profile_command",
        "time the real engine's steps and fit a cost model for `sendpath sim --cost-model`",
    ),
    "serve": (
        "sendpath.launch",
        "the whole stack: gateway + N local replicas on the built-in model (make serve)",
    ),
    "gateway": (
        "sendpath.gateway.command",
        "the gateway alone, in front of replicas that already run (--replica URL)",
    ),
    "keys": ("", "create, list, revoke API keys and show their usage"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every subcommand whole, or (``only``) that one whole and the
    others by name and help line alone (``""``: none whole, for `--help` and `--version`)."""
    parser = argparse.ArgumentParser(
        prog="sendpath",
        description="An LLM serving stack that shows what happens after a user presses send.",
    )
    parser.add_argument("--version", action="version", version=f"sendpath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    here: dict[str, Register] = {"version": _register_version, "generate": _register_generate,
                                 "keys": _register_keys}  # fmt: skip
    for name, (module, help) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help)
            continue
        register: Register = here[name] if not module else importlib.import_module(module).register
        register(sub, help)
    return parser


def _register_version(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    sub.add_parser("version", help=help).set_defaults(handler=_version)


def _version(args: argparse.Namespace) -> int:
    print(f"sendpath {__version__}")
    return 0


def _register_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    from sendpath.engine.args import MODEL_HELP, SPEC_HELP

    gen = sub.add_parser(
        "generate",
        help=help,
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
    gen.add_argument("--speculative-config", metavar="JSON", default=None, help=SPEC_HELP)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="a system message to put first")
    gen.add_argument(
        "--raw", action="store_true", help="complete the text as is, without the chat template"
    )
    gen.set_defaults(handler=_generate)


def _register_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    keys = sub.add_parser(
        "keys",
        help=help,
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
    keys.set_defaults(handler=_keys)


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
    try:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            speculative_config=args.speculative_config,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    given = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in given if not a.startswith("-")), None)
    if first == "sim" and not {"-h", "--help"} & set(given):
        # before the command's module imports the simulator: then that is the compiled one
        from sendpath.sim.compiled import use

        use(lambda message: print(message, file=sys.stderr, flush=True))
    parser = build_parser(first if first in COMMANDS else "")
    args = parser.parse_args(given)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        code: int = handler(args)
        return code
    except SendpathError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
