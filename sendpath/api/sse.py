"""Server-sent events as OpenAI streams them: ``data: <json>`` lines, ``[DONE]`` last.

One reading for every client of a stream here (the gateway's relay, the load generator's
client, which sends the calibration loads too): a line that is not a ``data:`` field (a comment, a
blank line between events, another field) carries no event; the payload is what follows
``data:``, without surrounding spaces. ``EventStreamResponse`` writes one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sendpath.api.disconnect import ClientGone, ClientWatch, Interrupt

__all__ = ["DONE", "EventStreamResponse", "data_of", "event", "sse_data"]

DONE = "[DONE]"  # the payload of a stream's last event
# made once (json.dumps with options builds an encoder on every call)
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def event(payload: dict[str, Any]) -> str:
    """One ``data:`` event of compact JSON (as ``server.responses.sse`` writes them)."""
    return f"data: {_ENCODER.encode(payload)}\n\n"


def data_of(line: str) -> str | None:
    """The payload of a ``data:`` line (``None``: the line carries no event)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The payload of each ``data:`` line of a stream's lines, in order (``[DONE]`` too)."""
    async for line in lines:
        payload = data_of(line)
        if payload is not None:
            yield payload


class EventStreamResponse(Response):
    """A ``text/event-stream`` body written as ``events`` yields it, in plain ASGI sends
    (Starlette's ``StreamingResponse`` runs a task group per response to notice a
    disconnect). ``events`` yields each write with whether more follows: the last one
    (``False``) also ends the body, in the same write; nothing may follow it, though
    ``events`` may still finish its work (the client is not waited for then). When the
    client leaves (``watch``), ``events`` is interrupted where it waits and closed, which
    is where a relay lets its upstream go."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[tuple[str, bool], None],
        watch: ClientWatch,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events, self.watch = events, watch
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        more = True
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with Interrupt() as stop:
                unwatch = self.watch.on_gone(lambda: stop.fire(ClientGone()))
                try:
                    async for chunk, more in self.events:
                        if not more:  # a server reports a finished response as a disconnect
                            unwatch()
                        body = chunk.encode()
                        await send({"type": "http.response.body", "body": body, "more_body": more})
                finally:
                    unwatch()
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass  # no one to write to
        finally:
            self.watch.close()
            await self.events.aclose()  # if a send was interrupted rather than `events`
