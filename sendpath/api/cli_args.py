"""What every server command's flags share: how long a client may take (the gateway's
and the replica's, each its own), the log's format, and the signal handlers `serve`
switches between while it starts and while it serves, and the port it takes first."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from types import FrameType

from sendpath.config import ConnectionLimits

__all__ = [
    "add_connection_args",
    "add_tracing_args",
    "bound_socket",
    "connection_limits",
    "ignore",
    "interrupt",
    "log_setup",
]

DEFAULTS = ConnectionLimits()  # the flags' defaults are the config's own


def log_setup() -> None:
    """Log lines as ``name: message`` at INFO (httpx's per-request lines left out)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request


def bound_socket(args: argparse.Namespace) -> socket.socket | None:
    """The server's socket on ``--host``/``--port``, bound before anything slow starts
    (``http_server.bind``); None once the reason it cannot be is on stderr."""
    from sendpath.api import http_server

    try:
        return http_server.bind(args.host, args.port)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    """Where the server's OpenTelemetry spans go (vLLM's flag; docs/observability.md)."""
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send each request's spans to this OTLP/HTTP collector, e.g. "
        "http://127.0.0.1:4318/v1/traces (default: off, unless OTEL_EXPORTER_OTLP_"
        "[TRACES_]ENDPOINT is set; needs the otel extra: pip install 'sendpath[otel]')",
    )


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """How long a client may take (the gateway's and the replica's, each its own)."""
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULTS.request_timeout_s,
        metavar="S",
        help="a client must send its whole request (head and body) within S seconds (%(default)g)",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=DEFAULTS.write_timeout_s,
        metavar="S",
        help="a client that reads nothing of its answer for S seconds is dropped and its "
        "request aborted (%(default)g)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULTS.keep_alive_s,
        metavar="S",
        help="an idle kept-alive connection is closed after S seconds (%(default)g)",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        request_timeout_s=args.request_timeout,
        write_timeout_s=args.write_timeout,
        keep_alive_s=args.keep_alive_timeout,
    )


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C (while starting: everything started so far is stopped)."""
    raise KeyboardInterrupt


def ignore(signum: int, frame: FrameType | None) -> None:
    """While uvicorn serves: it handles the signal itself, and re-raises it after."""
