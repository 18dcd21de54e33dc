"""Reading a replica's SSE stream: lines as they arrive, a network read at a time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from sendpath.gateway.chunks import Event, SSELines, read_head_events


async def reads(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_lines_split_across_reads_and_characters_split_across_reads() -> None:
    snowman = "☃".encode()

    async def run() -> list[list[str]]:
        lines = SSELines(
            reads(b"data: a\r\n\r\ndata: b", b"c\n\ndata: " + snowman[:1], snowman[1:])
        )
        return [await lines.batch(), await lines.batch(), await lines.batch(), await lines.batch()]

    # each read's complete lines at once; a last line without a newline at the end
    assert asyncio.run(run()) == [["data: a", ""], ["data: bc", ""], ["data: ☃"], []]


def parsed(line: str) -> Event:
    """A ``data:`` line as the head gives it: its payload and its chunk."""
    payload = line.removeprefix("data: ")
    return payload, json.loads(payload)


def test_the_head_stops_at_the_first_token_and_leaves_the_rest() -> None:
    role = 'data: {"choices":[{"delta":{"role":"assistant"}}]}'
    token = 'data: {"choices":[{"delta":{"content":"Hi"}}]}'
    body = f"{role}\n\n{token}\n\ndata: [DONE]\n\n".encode()

    async def run() -> tuple[list[Event], list[str]]:
        lines = SSELines(reads(body))
        return await read_head_events(lines), await lines.batch()

    head, rest = asyncio.run(run())
    assert head == [parsed(role), parsed(token)]
    assert rest == ["", "data: [DONE]", ""]


def test_carriage_returns_end_lines_too_and_a_failing_drain_is_quiet() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"data: a\r"
        yield b"\ndata: b\rdata: c\r\n"
        raise ConnectionResetError("the replica went away after [DONE]")

    async def run() -> list[str]:
        lines = SSELines(broken())
        got = [await lines.line(), await lines.line(), await lines.line()]
        await lines.drain(1.0)  # the answer is out: an error here is nobody's business
        return got

    assert asyncio.run(run()) == ["data: a", "data: b", "data: c"]


def test_what_a_read_brought_after_the_head_is_there_without_waiting() -> None:
    role = 'data: {"choices":[{"delta":{"role":"assistant"}}]}'
    token = 'data: {"choices":[{"delta":{"content":"Hi"}}]}'
    body = f"{role}\n\n{token}\n\ndata: [DONE]\n\n".encode()

    async def run() -> tuple[list[Event], list[str], list[str]]:
        lines = SSELines(reads(body))
        head = await read_head_events(lines)
        return head, lines.received(), lines.received()

    head, rest, nothing = asyncio.run(run())
    assert head == [parsed(role), parsed(token)]
    assert rest == ["", "data: [DONE]", ""]  # the same read: the relay writes it with the head
    assert nothing == []
