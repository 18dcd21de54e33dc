"""A client that goes away frees its slot and KV blocks.

Four cases: while queued, during prefill, mid-stream, and on a non-streaming request.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

import httpx

from sendpath.model.loader import LoadedModel
from tests.conftest import wait_for
from tests.server.conftest import BLOCKS, Server, serve

LONG = {"model": "tiny", "max_tokens": 1900, "ignore_eos": True}


def raw_post(server: Server, path: str, body: str) -> socket.socket:
    """Send a request on a bare socket (closing it is a real disconnect)."""
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    data = body.encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def engine_requests(server: Server) -> int:
    return len(server.core.scheduler.requests)


def test_disconnect_mid_stream(server: Server) -> None:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "prompt": "hello", "stream": True}
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any("text" in line for line in got)
        assert engine_requests(server) == 1
    assert server.idle()


def test_disconnect_non_streaming(server: Server) -> None:
    sock = raw_post(
        server,
        "/v1/completions",
        '{"model": "tiny", "prompt": "hello", "max_tokens": 1900, "ignore_eos": true}',
    )
    wait_for(
        lambda: server.core.scheduler.running and server.core.scheduler.running[0].output_token_ids
    )
    sock.close()
    assert server.idle()


def test_disconnect_during_prefill(tiny: LoadedModel) -> None:
    # a 1,500-token prompt in 8-token chunks takes ~190 steps to prefill
    with serve(tiny, max_num_batched_tokens=8) as server:
        body = (
            '{"model": "tiny", "prompt": ['
            + ",".join(["7"] * 1500)
            + '], "max_tokens": 5, "stream": true}'
        )
        sock = raw_post(server, "/v1/completions", body)
        wait_for(
            lambda: (
                server.core.scheduler.running
                and server.core.scheduler.running[0].num_computed_tokens > 0
            )
        )
        request = server.core.scheduler.running[0]
        sock.close()
        assert server.idle()
        assert request.output_token_ids == [] and request.num_computed_tokens < 1500
        assert server.core.scheduler.kv.pool.num_free_blocks == BLOCKS


def test_disconnect_while_queued(tiny: LoadedModel) -> None:
    with serve(tiny, max_num_seqs=1) as server:
        stop = threading.Event()

        def hold() -> None:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={**LONG, "prompt": "first", "stream": True},
                timeout=60,
            ) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        holder = threading.Thread(target=hold)
        holder.start()
        wait_for(lambda: len(server.core.scheduler.running) == 1)
        queued = raw_post(
            server, "/v1/completions", '{"model": "tiny", "prompt": "second", "max_tokens": 5}'
        )
        wait_for(lambda: len(server.core.scheduler.waiting) == 1)
        waiting = next(iter(server.core.scheduler.waiting))
        queued.close()
        wait_for(lambda: len(server.core.scheduler.waiting) == 0)
        assert waiting.status.value == "aborted" and waiting.output_token_ids == []
        stop.set()
        holder.join(30)
        assert server.idle()
