"""The guarded uvicorn protocol on real sockets: a client that sends half a request is cut
off after the request timeout, and one that stops reading is dropped after the write
timeout, which the app sees as a disconnect."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from sendpath.api.disconnect import signal_of
from sendpath.api.http_server import HeadWithBody, uvicorn_config
from sendpath.config import ConnectionLimits
from tests.conftest import wait_for

LIMITS = ConnectionLimits(request_timeout_s=0.5, write_timeout_s=0.5, send_buffer_bytes=4096)


class Events:
    def __init__(self) -> None:
        self.closed = threading.Event()  # the endless stream's generator was closed
        self.sent = 0
        self.watching = threading.Event()  # /watched has its disconnect signal
        self.gone = threading.Event()  # and it was set


@contextmanager
def server(events: Events) -> Iterator[int]:
    async def endless(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            try:
                while True:
                    events.sent += 1
                    yield "data: " + "x" * 200 + "\n\n"
                    await asyncio.sleep(0)
            finally:
                events.closed.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    async def refuse(request: Request) -> PlainTextResponse:  # answers before the body
        return PlainTextResponse("no", status_code=401)

    async def watched(request: Request) -> PlainTextResponse:  # answers once its client left
        signal = signal_of(request.scope)
        assert signal is not None and not signal.gone
        left = asyncio.Event()
        signal.subscribe(left.set)
        events.watching.set()
        await left.wait()
        events.gone.set()
        return PlainTextResponse("too late")

    app = Starlette(
        routes=[
            Route("/stream", endless),
            Route("/echo", echo, methods=["POST"]),
            Route("/refuse", refuse, methods=["POST"]),
            Route("/watched", watched),
        ]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, LIMITS))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    wait_for(lambda: srv.started)
    try:
        yield sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(10)


def closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        while conn.recv(65536):
            pass
    except (TimeoutError, ConnectionResetError):
        return False
    return True


def test_half_sent_requests_are_cut_off_and_whole_ones_answered() -> None:
    with server(Events()) as port:
        heads = []
        for _ in range(20):  # slowloris: heads that never end
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
            heads.append(c)
        body = socket.create_connection(("127.0.0.1", port))  # a body that never comes
        body.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        assert all(closed_by_server(c, within=5) for c in [*heads, body])
        whole = socket.create_connection(("127.0.0.1", port))
        whole.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert whole.recv(4096).startswith(b"HTTP/1.1 200 OK")


def test_a_body_sent_after_its_answer_does_not_keep_the_connection_open() -> None:
    with server(Events()) as port:
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 401")
        c.sendall(b"abc")  # the body, late: then nothing more
        assert closed_by_server(c, within=5)  # the request timeout, not never


def test_a_client_that_stops_reading_is_dropped_and_the_app_sees_it() -> None:
    events = Events()
    with server(events) as port:
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", port))
        c.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        # it reads nothing: once its buffers are full it is dropped, and the stream's
        # generator is closed (a replica's would abort its request there)
        assert events.closed.wait(10)
        assert events.sent * 206 < 2**20  # after a bounded amount, not megabytes
        c.close()


class Recorder:
    """A transport that records its writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> str:
        return f"info {name}"


def test_a_head_goes_out_with_its_body_in_one_write() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sent = Recorder()
        cycle = HeadWithBody(sent, loop)  # type: ignore[arg-type]
        cycle.write(b"HEAD\r\n\r\n")
        assert sent.writes == []  # held for the body
        cycle.write(b"body")
        cycle.write(b"more")
        assert sent.writes == [b"HEAD\r\n\r\nbody", b"more"]
        await asyncio.sleep(0)  # nothing left held
        assert sent.writes == [b"HEAD\r\n\r\nbody", b"more"]
        assert cycle.get_extra_info("peername") == "info peername"

        alone = Recorder()
        cycle = HeadWithBody(alone, loop)  # type: ignore[arg-type]
        cycle.write(b"HEAD")  # no body in this turn of the loop: it goes alone
        await asyncio.sleep(0)
        assert alone.writes == [b"HEAD"]

        closing = Recorder()
        cycle = HeadWithBody(closing, loop)  # type: ignore[arg-type]
        cycle.write(b"HEAD")
        cycle.close()  # flushed first
        assert closing.writes == [b"HEAD"] and closing.closed
        await asyncio.sleep(0)
        assert closing.writes == [b"HEAD"]

    asyncio.run(main())


def test_the_server_writes_a_whole_short_answer_at_once() -> None:
    with server(Events()) as port:
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        answer = c.recv(65536)  # head and body came in one segment
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\n3")
        c.close()


def test_a_request_is_told_its_client_left_without_reading_its_receive() -> None:
    events = Events()
    with server(events) as port:
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"GET /watched HTTP/1.1\r\nHost: x\r\n\r\n")
        assert events.watching.wait(10)
        assert not events.gone.is_set()
        c.close()  # the connection is lost before the response: the signal is set
        assert events.gone.wait(10)
