"""The mock upstream of ``gateway_overhead.py``: a bare asyncio server in OpenAI's shape
that answers every request at once (a streamed chat: role, 14 text chunks, finish, usage,
``[DONE]``), so its own cost is small and the gateway's is what is measured.

    python -c "from benchmarks.mock_replica import run_mock; run_mock(PORT)"
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

__all__ = ["PROMPT", "run_mock"]

WORDS = [
    "Tokyo",
    " is",
    " the",
    " capital",
    " of",
    " Japan",
    ",",
    " a",
    " city",
    " of",
    " fourteen",
    " million",
    " people",
    ".",
]
PROMPT = "What is the capital of Japan? Answer in one sentence."


def mock_events() -> bytes:
    """The whole streamed answer, as one chunked HTTP body (sent at once)."""
    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": "mock"}
    chunks: list[dict[str, Any]] = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    ]
    for word in WORDS:
        delta = {"index": 0, "delta": {"content": word}, "finish_reason": None}
        chunks.append({**base, "choices": [delta]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 12, "completion_tokens": len(WORDS), "total_tokens": 26}
    chunks.append({**base, "choices": [], "usage": usage})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    data = text.encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"


def mock_json(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
    return head.encode() + b"\r\n" + data


class MockReplica(asyncio.Protocol):
    """Just enough of a replica for the gateway: /ready, /health, /load, /tokenize (a key
    with token limits has its prompt counted there), and the stream."""

    STREAM = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + mock_events()
    )
    LOAD = mock_json({"num_requests_running": 0, "num_requests_waiting": 0})
    OK = mock_json({"status": "ok"})
    TOKENS = mock_json({"count": 20, "max_model_len": 8192})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            path = head.split(" ", 2)[1]
            if path.startswith("/v1/"):
                self.transport.write(self.STREAM)
            elif path == "/load":
                self.transport.write(self.LOAD)
            elif path == "/tokenize":
                self.transport.write(self.TOKENS)
            else:
                self.transport.write(self.OK)


def run_mock(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(MockReplica, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):  # how the benchmark stops it
        asyncio.run(main())
