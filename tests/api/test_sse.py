"""Reading SSE lines as OpenAI streams them, and writing a stream that stops when the
client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.types import Message

from sendpath.api.disconnect import ClientWatch
from sendpath.api.sse import DONE, EventStreamResponse, data_of, sse_data


def test_only_data_lines_carry_an_event_without_surrounding_spaces() -> None:
    assert data_of('data: {"a":1} ') == '{"a":1}'
    assert data_of("data:[DONE]") == DONE
    assert data_of("") is None
    assert data_of(": keep-alive") is None
    assert data_of("event: error") is None


def test_the_payloads_of_a_stream_in_order() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in ["data: 1", "", ": comment", "data:  2", "", "data: [DONE]", ""]:
            yield line

    async def run() -> list[str]:
        return [p async for p in sse_data(lines())]

    assert asyncio.run(run()) == ["1", "2", DONE]


def test_a_stream_is_written_in_plain_sends_its_last_write_ending_the_body() -> None:
    sent: list[Message] = []
    finished: list[str] = []

    async def events() -> AsyncGenerator[tuple[str, bool], None]:
        yield "data: 1\n\n", True
        yield "data: [DONE]\n\n", False
        finished.append("after the end")  # work after the last write still runs

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    async def run() -> None:
        response = EventStreamResponse(events(), ClientWatch(receive), {"x-a": "b"})
        await response({"type": "http"}, receive, send)

    asyncio.run(run())
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert (b"x-a", b"b") in sent[0]["headers"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert [m.get("more_body") for m in sent[1:]] == [True, False]
    assert finished == ["after the end"]


def test_a_stream_that_stops_without_a_last_write_is_ended_all_the_same() -> None:
    sent: list[Message] = []

    async def events() -> AsyncGenerator[tuple[str, bool], None]:
        yield "data: 1\n\n", True

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    async def run() -> None:
        await EventStreamResponse(events(), ClientWatch(receive))({"type": "http"}, receive, send)

    asyncio.run(run())
    assert [(m.get("body"), m.get("more_body")) for m in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"", False),
    ]


def test_a_client_that_leaves_stops_the_stream_where_it_waits_and_closes_it() -> None:
    closed: list[str] = []
    sent: list[Message] = []

    async def run() -> None:
        left = asyncio.Event()
        waiting = asyncio.Event()

        async def events() -> AsyncGenerator[tuple[str, bool], None]:
            try:
                yield "data: 1\n\n", True
                waiting.set()
                await asyncio.Event().wait()  # the upstream sends nothing more
                yield "never", False
            finally:
                closed.append("closed")

        async def receive() -> Message:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        response = EventStreamResponse(events(), ClientWatch(receive))
        task = asyncio.create_task(response({"type": "http"}, receive, send))
        await waiting.wait()
        left.set()
        await task  # returns: nobody is left to write to
        assert not task.cancelled()

    asyncio.run(run())
    assert closed == ["closed"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # no end: nobody reads it
