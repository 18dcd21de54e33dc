"""The gateway's HTTP/1.1 client to its replicas: pooled keep-alive connections on asyncio
protocols, each response parsed by httptools (llhttp, in C: the server side's parser).

It does what a proxy needs per request and no more: one write for a POST's head and body,
the response's status and headers, then its body as each network read brings it
(``content.iter_any()``, chunked transfer decoded) or whole (``read()``). aiohttp did the
same through a request and a response object of many parts (URL and header types, a
payload registry, trace hooks, a timer per call): with this client the gateway spends
about a fifth less CPU per streamed request (``benchmarks/gateway_overhead.py``).

Connections are pooled per replica (scheme, host, port). One goes back to the pool when
its response was read to the end and both sides keep it alive, and is not reused after
``keepalive_s`` idle: before the replica's own keep-alive bound closes it under a request
(a POST is never sent twice). ``release()`` before the end closes it, which aborts the
request at the replica. A body is read as fast as it is consumed: with more than
``HIGH_WATER`` bytes unread, the connection stops reading from its socket.

Errors are ``UpstreamConnectionError``: ``ConnectFailed`` (no connection: refused,
unreachable; ``ConnectTimeout`` when not within ``connect_s``) or ``UpstreamDisconnected``
(the connection ended or broke before the response did, or what came back is not HTTP).
Timeouts other than the connect's are the caller's (``asyncio.timeout`` around a call).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "UpstreamClient",
    "UpstreamConnectionError",
    "UpstreamDisconnected",
    "UpstreamResponse",
]

HIGH_WATER = 256 * 1024  # unread body bytes past which a connection stops reading
_Target = tuple[str, str, int, str, bytes]  # scheme, host, port, request target, Host header


class UpstreamConnectionError(Exception):
    """Talking to a replica failed."""


class ConnectFailed(UpstreamConnectionError):
    """No connection to the replica could be made."""


class ConnectTimeout(ConnectFailed, TimeoutError):
    """No connection to the replica within the connect timeout."""


class UpstreamDisconnected(UpstreamConnectionError):
    """The connection ended or broke before the response did (or it was not HTTP)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its response's state here."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # a request is on it (else data from the replica is unexpected)
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.start()

    def start(self) -> None:
        """A new request on this connection: its response's state from scratch."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.framed = False  # the body's end is marked (a length or chunked), not the close
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.error: UpstreamConnectionError | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing was asked: a pooled connection the replica is closing
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = UpstreamDisconnected(f"the replica's response is not HTTP ({exc})")
            self.close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.framed and exc is None:
            self.complete = True  # a body that ends with the connection
        elif not self.complete and self.error is None:
            why = f": {exc}" if exc is not None else ""
            self.error = UpstreamDisconnected(f"the replica closed the connection{why}")
        self._wake()

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self.framed = (
            "content-length" in self.headers
            or "chunked" in self.headers.get("transfer-encoding", "")
            or self.status in (204, 304)
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # for the client and the response

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        """Until the protocol's next event (a head, body, the end, an error)."""
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take_body(self) -> bytes:
        """What the body brought since the last call (and reading resumes)."""
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body:
    """A response's body as it arrives (aiohttp's ``content``): ``iter_any()`` gives what
    each read brought, ``at_eof()`` says whether all of it was taken."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn

    def iter_any(self) -> _Body:
        return self

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        while (conn := self._conn) is not None:
            if conn.body:
                return conn.take_body()
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        raise StopAsyncIteration

    def at_eof(self) -> bool:
        conn = self._conn
        return conn is None or (conn.complete and not conn.body)

    def detach(self) -> None:
        self._conn = None


class UpstreamResponse:
    """A replica's response: status and headers (names in lower case) now, the body as it
    is read; ``release()`` (once done with it) pools or closes its connection."""

    def __init__(self, client: UpstreamClient, key: tuple[str, str, int], conn: _Connection):
        self.status, self.headers = conn.status, conn.headers
        self.content = _Body(conn)
        self._client, self._key = client, key
        self._conn: _Connection | None = conn

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        return b"".join([data async for data in self.content])

    def release(self) -> None:
        """To the pool if the response was read to the end, else closed (which aborts the
        request at the replica). Only the first call counts."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self.content.detach()
        if conn.complete and not conn.body and conn.keep_alive and not conn.closed:
            self._client.put_back(self._key, conn)
        else:
            conn.close()


class UpstreamClient:
    """Pooled keep-alive connections to the replicas (module docstring)."""

    def __init__(self, connect_s: float, keepalive_s: float) -> None:
        self.connect_s, self.keepalive_s = connect_s, keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}  # URL -> its parts, parsed once
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` to ``url`` and wait for the response's head (``on_sent``: called
        once the request is written). On any failure or cancellation the connection is
        closed, which aborts the request at the replica if it got there."""
        scheme, host, port, target, host_header = self._target(url)
        key = (scheme, host, port)
        head = [b"POST ", target.encode(), b" HTTP/1.1\r\nhost: ", host_header]
        head.append(b"\r\ncontent-length: %d\r\n" % len(body))
        for name, value in headers.items():
            line = f"{name}: {value}"
            if "\r" in line or "\n" in line:  # would end the header early: a second request
                raise ValueError(f"a header for the replica holds a line break: {name!r}")
            head.append(f"{line}\r\n".encode("latin-1"))
        head += [b"\r\n", body]
        conn = self._take(key) or await self._connect(scheme, host, port)
        try:
            conn.start()
            conn.busy = True
            assert conn.transport is not None
            conn.transport.write(b"".join(head))
            if on_sent is not None:
                on_sent()
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, key, conn)

    def put_back(self, key: tuple[str, str, int], conn: _Connection) -> None:
        conn.busy = False
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(key, []).append(conn)

    async def aclose(self) -> None:
        """Close every pooled connection (those in use close when released)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        """The most recently pooled connection still open and fresh (stale ones closed)."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.loop.time() - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            self._ssl = context = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=context
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"no connection to {host}:{port} within {self.connect_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def _target(self, url: str) -> _Target:
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host_header = parts.netloc.rpartition("@")[2].encode()  # no user info
            found = (parts.scheme, parts.hostname, port, target, host_header)
            if len(self._targets) >= 1024:
                self._targets.clear()
            self._targets[url] = found
        return found
