"""`sendpath chat`: send one message, stream the answer, then show where the time went.

The stages come from the server's trace (``GET /v1/traces/{id}``); ``network`` is what the
client waited beyond the server's own total. Against a server that keeps no traces, the
``timings`` of the last chunk are laid end to end instead; against one that sends no
timings at all, only the client's own measurements are shown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import httpx
from rich.console import Console

from sendpath.bench.client import RequestResult, stream_chat
from sendpath.bench.report import NOT_STAGES
from sendpath.waterfall import draw, with_network

__all__ = ["add_chat_args", "register", "run_chat"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], help: str) -> None:
    """The `chat` subcommand: its flags, and ``run_chat`` as its handler."""
    chat = sub.add_parser(
        "chat",
        help=help,
        description="Send one chat message to an OpenAI-compatible server (sendpath serve by "
        "default), stream the answer, then draw each stage of its path (network included).",
    )
    add_chat_args(chat)
    chat.set_defaults(handler=run_chat)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", help="the user message")
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SENDPATH_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $SENDPATH_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--system", default=None, help="a system message to put first")
    p.add_argument("--json", action="store_true", help="print the timeline as JSON instead")


def sequential_stages(timings: dict[str, float]) -> list[dict[str, Any]]:
    """Stages from a ``timings`` object, laid end to end in its order."""
    out, t = [], 0.0
    for name, ms in timings.items():
        if name not in NOT_STAGES:
            out.append({"stage": name, "start_ms": t, "duration_ms": ms})
            t += ms
    return out


async def _chat(args: argparse.Namespace) -> tuple[RequestResult, dict[str, Any] | None]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=600) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models", headers=headers)
            if r.status_code != 200:
                raise SystemExit(f"error: GET /v1/models said {r.status_code}: {r.text[:300]}")
            model = r.json()["data"][0]["id"]
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
        extra = {} if args.temperature is None else {"temperature": args.temperature}
        on_text = None if args.json else (lambda t: print(t, end="", flush=True))
        result = await stream_chat(
            client, model, messages, args.max_tokens, args.api_key, on_text, **extra
        )
        trace = None
        if result.success and result.request_id:
            r = await client.get(f"/v1/traces/{result.request_id}", headers=headers)
            found = r.json() if r.status_code == 200 else None
            trace = found if found and found.get("object") == "trace" else None
        return result, trace


def run_chat(args: argparse.Namespace) -> int:
    """The `sendpath chat` command."""
    try:
        result, trace = asyncio.run(_chat(args))
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if not result.success:
        print(f"\nerror: {result.error}", file=sys.stderr)
        return 1
    stages = trace["stages"] if trace else sequential_stages(result.timings)
    network = result.network_ms
    if args.json:
        print(json.dumps({
            "id": result.request_id,
            "text": result.text,
            "client": {
                "ttft_ms": round((result.ttft or 0.0) * 1000, 3),
                "e2e_ms": round(result.latency * 1000, 3),
                "output_tokens": result.output_tokens,
            },
            "network_ms": network,
            "stages": with_network(stages, network),  # as the waterfall draws them
            "trace": trace,
        }, indent=2))  # fmt: skip
        return 0
    print()
    console = Console()
    if not stages:
        console.print(
            f"[dim]the server sent no timings: client TTFT {result.ttft or 0:.3f} s, "
            f"E2E {result.latency:.3f} s[/dim]"
        )
        return 0
    draw(stages, network, console, title=f"where the time went ({result.request_id})")
    if trace is not None and trace.get("routing"):
        console.print(routing_line(trace.get("replica"), trace["routing"]))
    return 0


def routing_line(replica: str | None, routing: dict[str, Any]) -> str:
    """Where the request went and why: the policy, what it expected the replica to hold
    of the prompt, what the replica then said it had cached, and where it runs."""
    line = f"routed to {replica or 'a replica'} by {routing.get('policy')}"
    if "match" in routing:
        blocks = f"{routing['matched_blocks']} of {routing['prompt_blocks']} prompt blocks"
        predicted = routing.get("predicted_cached_tokens")
        expected = f"{predicted} tokens, " if predicted is not None else ""
        line += f": expected {expected}{blocks} cached ({routing['match']})"
    if routing.get("cached_tokens") is not None:
        line += f"; the replica had {routing['cached_tokens']} cached"
    where = routing.get("runs_on") or {}
    if where:
        line += f"; it runs on {where.get('host')} (Ray node {str(where.get('node'))[:12]})"
    return line
