"""Running an ASGI app with uvicorn, guarded against clients that are slow on purpose.

uvicorn closes a keep-alive connection that stays idle, but not one that sends half a
request and stops (a hundred of those hold a hundred connections forever), nor one that
stops reading a streamed answer (its writes wait for ever, holding the request's slot
and KV blocks). ``GuardedProtocol`` adds both bounds at the connection (on uvicorn's
httptools protocol, the fast one; with uvloop, which uvicorn picks when installed):

- ``request_timeout_s``: from the moment a connection waits for a request (opened, or its
  last response done), the request's head and body must arrive within this; else the
  connection is closed (the app, if it is reading the body, sees a disconnect);
- ``write_timeout_s``: when the connection's send buffer is full (the client reads
  nothing) for this long, the connection is dropped: the app sees a disconnect, which
  aborts the request wherever it is, as if the client had hung up. The buffer is bounded
  (``send_buffer_bytes`` in the kernel and as many again in the process; Linux would
  otherwise grow a loopback socket's to megabytes, a whole long answer's worth, so a
  client that stops reading would never be noticed). Streamed tokens are a few hundred
  bytes a second, far below what such a buffer carries even over a slow link.

A response's head is written with the first part of its body (``HeadWithBody``): uvicorn
writes each ASGI message as it comes, so a head and a body sent in the same turn of the
loop were two writes to the socket, two segments and two wake-ups of the client.

Each request's scope carries a ``DisconnectSignal`` (``disconnect.py``) in its
extensions, set when the connection is lost before the response is complete: what
``receive()`` would say, so an app can follow its client without a task waiting on it.

``bind(host, port)`` then ``run(app, sock, limits)`` is what the commands call;
``limits`` also carries the keep-alive idle bound (uvicorn's own).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sendpath.api.disconnect import SIGNAL_KEY, DisconnectSignal
from sendpath.config import ConnectionLimits

__all__ = ["GuardedProtocol", "HeadWithBody", "bind", "run", "uvicorn_config"]

logger = logging.getLogger("sendpath.http")


class HeadWithBody:
    """A connection's transport as one request's cycle writes to it: the cycle's first
    write (its response's head, or a 100 Continue) is held until its next write, which
    takes it along, or until the end of the loop's turn, when it goes alone. Nothing is
    reordered and nothing waits longer than the turn it was written in. A held write is
    flushed before ``close``; it is dropped if the connection closes first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._first = True
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = bytes(data)
            self._flush = self._loop.call_soon(self.flush)
            return
        if self._held is not None:
            data = self._held + data
            self._held = None
            assert self._flush is not None
            self._flush.cancel()
        self._transport.write(data)

    def flush(self) -> None:
        """Write what is held now."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # the rest as the transport has it
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C) with a request timeout and a
    write-stall timeout.

    ``limits`` is a class attribute: ``uvicorn_config`` makes a subclass per server with its
    own, and a ``--workers`` process sets it from its config before serving."""

    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._unanswered = 0  # requests received whole whose response is not done yet
        self._disconnect = DisconnectSignal(self.loop)  # the current cycle's
        super().connection_made(transport)
        size = self.limits.send_buffer_bytes
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        transport.set_write_buffer_limits(high=size)
        self._request_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._arm_request_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._request_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        if self.cycle is not None and not self.cycle.response_complete:  # as uvicorn says
            self._disconnect.set()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a new request's cycle: its head goes with its body
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
            # and its client's disconnect is told without a task waiting on receive()
            self._disconnect = DisconnectSignal(self.loop)
            scope = cast(dict[str, Any], self.cycle.scope)
            scope.setdefault("extensions", {})[SIGNAL_KEY] = self._disconnect

    def on_message_complete(self) -> None:
        if not self.cycle.response_complete:  # else answered before its body was in (a 401)
            self._unanswered += 1
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._unanswered = max(0, self._unanswered - 1)
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_request_timer()  # the next request on this connection: same bound

    def _arm_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
        self._request_timer = self.loop.call_later(
            self.limits.request_timeout_s, self._request_timed_out
        )

    def _request_timed_out(self) -> None:
        self._request_timer = None
        # nothing to answer: the connection waits on the client (a request's head or body,
        # or a next request); a pipelined request waits on us while its predecessor runs
        if self._unanswered == 0 and not self.transport.is_closing():
            logger.info(
                "client %s did not send its request within %g s: connection closed",
                _peer(self.client),
                self.limits.request_timeout_s,
            )
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        logger.warning(
            "client %s read nothing for %g s: connection dropped, its request aborted",
            _peer(self.client),
            self.limits.write_timeout_s,
        )
        self.transport.abort()  # close() would wait to flush what the client never reads


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def uvicorn_config(
    app: Any, host: str, port: int, limits: ConnectionLimits, **options: Any
) -> uvicorn.Config:
    """A uvicorn config with the guarded protocol (``options``: uvicorn's own)."""
    protocol = type(GuardedProtocol.__name__, (GuardedProtocol,), {"limits": limits})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
        log_level="warning",
        **options,
    )


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening. A command takes it before its
    slow start (replicas loading), so a port in use fails at once, before minutes of
    work, and nothing started meanwhile can take it; until ``run`` listens, a connection
    is refused, not left waiting. Port 0 takes a free port (``sock.getsockname()``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror}): stop what holds the port, "
            "or pick another with --port"
        ) from exc
    return sock


def run(
    app: Any,
    sock: socket.socket,
    limits: ConnectionLimits,
    listening: Callable[[], None] = lambda: None,
    **options: Any,
) -> None:
    """Serve ``app`` on ``sock`` (from ``bind``) until interrupted (uvicorn.run with the
    guarded protocol). ``listening`` runs once the socket listens: a connection made after
    it waits in the backlog until the app is up, never refused."""
    host, port = sock.getsockname()[:2]
    config = uvicorn_config(app, host, port, limits, **options)
    sock.listen(config.backlog)  # (uvicorn listens once the app is up; this is earlier)
    listening()
    uvicorn.Server(config).run(sockets=[sock])
