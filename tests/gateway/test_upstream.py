"""The gateway's client to its replicas, against a scripted HTTP server on loopback: a
body as each read brings it, connections reused or closed, and each failure's error. On
asyncio's own loop and on uvloop's (the one the gateway serves on)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from sendpath.gateway.upstream import (
    ConnectFailed,
    UpstreamClient,
    UpstreamDisconnected,
    UpstreamResponse,
)

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


LoopFactory = Callable[[], asyncio.AbstractEventLoop] | None
LOOP: dict[str, LoopFactory] = {"factory": None}  # the loop of the test that runs


@pytest.fixture(autouse=True, params=[None, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def loop_factory(request: pytest.FixtureRequest) -> None:
    LOOP["factory"] = request.param


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """``main`` on the loop the test is parametrized with."""
    with asyncio.Runner(loop_factory=LOOP["factory"]) as runner:
        return runner.run(main)


class Replica:
    """Answers each request on a connection with ``handler(request, writer)``; counts
    the connections and keeps each request as it arrived."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection ended from the client's side

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.handler(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


def run(handler: Handler, test: Callable[[UpstreamClient, str, Replica], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        replica = Replica(handler)
        server = await asyncio.start_server(replica.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = UpstreamClient(connect_s=5.0, keepalive_s=60.0)
        try:
            return await test(client, f"http://127.0.0.1:{port}", replica)
        finally:
            await client.aclose()
            server.close()

    return run_loop(main())


async def whole(answer: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Request-Id: r1\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
    )


def test_a_post_goes_out_in_one_piece_and_its_answer_is_read_whole() -> None:
    async def test(client: UpstreamClient, url: str, replica: Replica) -> tuple[Any, ...]:
        r = await client.post(url + "/v1/chat/completions", b'{"a": 1}', {"x-key": "k"})
        body = await r.read()
        r.release()
        return r.status, r.headers, body, replica.requests

    status, headers, body, requests = run(lambda _, w: whole(b'{"ok": true}', w), test)
    assert status == 200 and body == b'{"ok": true}'
    assert headers["x-request-id"] == "r1"  # names in lower case
    assert headers["content-type"] == "application/json"
    head, _, sent = requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert b"x-key: k" in lines and b"content-length: 8" in lines
    assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)
    assert sent == b'{"a": 1}'


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def test(client: UpstreamClient, url: str, replica: Replica) -> int:
        with pytest.raises(ValueError, match="line break"):
            await client.post(url + "/v1/completions", b"{}", {"x-key": "k\r\nx-admin: 1"})
        return replica.connections

    assert run(lambda _, w: whole(b"{}", w), test) == 0  # not even a connection made


def test_a_connection_read_to_the_end_is_reused_and_a_stale_one_is_not() -> None:
    async def test(client: UpstreamClient, url: str, replica: Replica) -> list[int]:
        counts = []
        for _ in range(3):
            r = await client.post(url + "/tokenize", b"{}", {})
            await r.read()
            r.release()
            counts.append(replica.connections)
        client.keepalive_s = 0.0  # every pooled connection is now too old to use
        r = await client.post(url + "/tokenize", b"{}", {})
        await r.read()
        r.release()
        counts.append(replica.connections)
        return counts

    assert run(lambda _, w: whole(b"{}", w), test) == [1, 1, 1, 2]


def test_a_chunked_body_comes_as_each_read_brings_it() -> None:
    more = asyncio.Event()

    async def stream(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await more.wait()  # the client has read the first part
        writer.write(b"3\r\n1\n\n\r\n0\r\n\r\n")

    async def test(client: UpstreamClient, url: str, replica: Replica) -> list[Any]:
        r = await client.post(url + "/v1/completions", b"{}", {})
        body = r.content.iter_any()
        first = await anext(body)
        at_eof = r.content.at_eof()
        more.set()
        rest = [data async for data in body]
        out = [first, at_eof, rest, r.content.at_eof()]
        r.release()
        return out

    assert run(stream, test) == [b"data: ", False, [b"1\n\n"], True]


def test_releasing_a_response_before_its_end_closes_the_connection() -> None:
    async def endless(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")

    async def test(client: UpstreamClient, url: str, replica: Replica) -> int:
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert await anext(r.content.iter_any()) == b"abc"
        r.release()  # the client left: the replica sees the connection end
        await replica.closed.wait()
        r = await client.post(url + "/v1/completions", b"{}", {})
        r.release()
        return replica.connections

    assert run(endless, test) == 2  # the released one was not pooled


def test_a_replica_that_closes_mid_body_is_an_upstream_disconnect() -> None:
    async def cut(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        writer.close()

    async def test(client: UpstreamClient, url: str, replica: Replica) -> None:
        r = await client.post(url + "/v1/completions", b"{}", {})
        with pytest.raises(UpstreamDisconnected, match="closed the connection"):
            await r.read()
        r.release()

    run(cut, test)


def test_an_answer_that_is_not_http_or_none_at_all_is_an_upstream_disconnect() -> None:
    async def garbage(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def hang_up(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def test(client: UpstreamClient, url: str, replica: Replica) -> None:
        with pytest.raises(UpstreamDisconnected):
            await client.post(url + "/v1/completions", b"{}", {})

    run(garbage, test)
    run(hang_up, test)


def test_no_replica_listening_is_a_connect_failure() -> None:
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        client = UpstreamClient(connect_s=5.0, keepalive_s=4.0)
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})

    run_loop(main())


def test_a_cancelled_post_closes_its_connection() -> None:
    async def silent(request: bytes, writer: asyncio.StreamWriter) -> None:
        pass  # never answers

    async def test(client: UpstreamClient, url: str, replica: Replica) -> None:
        post = asyncio.ensure_future(client.post(url + "/v1/completions", b"{}", {}))
        while not replica.requests:  # it reached the replica
            await asyncio.sleep(0)
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        await replica.closed.wait()  # which saw the connection end: the request aborted

    run(silent, test)


def test_a_response_is_released_once() -> None:
    async def test(client: UpstreamClient, url: str, replica: Replica) -> int:
        r: UpstreamResponse = await client.post(url + "/x", b"{}", {})
        await r.read()
        r.release()
        r.release()  # the second does nothing (the connection is pooled once)
        for _ in range(2):
            r = await client.post(url + "/x", b"{}", {})
            await r.read()  # both on the same connection: not handed out twice
        return replica.connections

    assert run(lambda _, w: whole(b"{}", w), test) == 2
