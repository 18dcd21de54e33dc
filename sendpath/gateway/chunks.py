"""OpenAI stream chunks as the gateway reads and rewrites them (torch-free helpers)."""

from __future__ import annotations

import asyncio
import codecs
import json
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from sendpath.api.sse import DONE, data_of

# One event of a stream: its payload, and its chunk parsed (``None``: ``[DONE]``)
Event = tuple[str, dict[str, Any] | None]

__all__ = [
    "Event",
    "SSELines",
    "answer_text",
    "arguments_chunk",
    "call_part",
    "event_of",
    "finished",
    "index_of",
    "numbers",
    "read_head_events",
    "text_of",
    "tool_calls_of",
    "with_arguments",
    "with_text",
]


def _split(text: str) -> list[str]:
    """Lines ended by \\n, \\r\\n or \\r (SSE's three), the last one unended."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


class SSELines:
    """A stream's lines as they arrive, one network read at a time.

    ``line()`` gives the next line; ``batch()`` every complete line already received (at
    least one: it waits only when none is; ``received()`` never waits), so a relay writes
    what one read brought in one write instead of one per event. Lines end at ``\n``,
    ``\r\n`` or ``\r`` (SSE's
    three); a last line without one is given at the end."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._partial = ""
        self._ready: deque[str] = deque()

    async def _fill(self) -> bool:
        """Read until a complete line is buffered; ``False`` at the end of the stream."""
        while not self._ready:
            try:
                data = await anext(self._chunks)
            except StopAsyncIteration:
                rest = (self._partial + self._decoder.decode(b"", final=True)).rstrip("\r")
                self._partial = ""
                if not rest:
                    return False
                self._ready.extend(_split(rest))
                return True
            text = self._partial + self._decoder.decode(data)
            held = text.endswith("\r")  # maybe the first half of a \r\n
            *lines, self._partial = _split(text[:-1] if held else text)
            self._partial += "\r" if held else ""
            self._ready.extend(lines)
        return True

    async def line(self) -> str:
        """The next line (``StopAsyncIteration`` at the end)."""
        if not self._ready and not await self._fill():
            raise StopAsyncIteration
        return self._ready.popleft()

    async def drain(self, within_s: float) -> None:
        """Read what is left of a finished stream (its last chunk of the HTTP body), so the
        connection can go back to the pool rather than be closed; give up after ``within_s``."""
        try:
            async with asyncio.timeout(within_s):
                async for _ in self._chunks:
                    pass
        except Exception:  # best effort: the answer is already out; else it is closed
            pass

    async def batch(self) -> list[str]:
        """Every complete line received so far, waiting for one if none is (``[]``: the end)."""
        if not self._ready and not await self._fill():
            return []
        return self.received()

    def received(self) -> list[str]:
        """Every complete line received so far, without waiting (``[]``: none yet)."""
        out = list(self._ready)
        self._ready.clear()
        return out


def index_of(choice: dict[str, Any]) -> int:
    """A choice's ``index`` (0 when it has none, or not a number)."""
    index = choice.get("index", 0)
    return index if isinstance(index, int) else 0


def text_of(choice: dict[str, Any]) -> str | None:
    if "delta" in choice:
        content = choice["delta"].get("content")
        return content if isinstance(content, str) else None
    text = choice.get("text")
    return text if isinstance(text, str) else None


def tool_calls_of(choice: dict[str, Any]) -> list[Any] | None:
    """The tool-call pieces a chat delta carries (``None``: none)."""
    delta = choice.get("delta")
    calls = delta.get("tool_calls") if isinstance(delta, dict) else None
    return calls if isinstance(calls, list) and calls else None


def call_part(choice: dict[str, Any]) -> tuple[int, str] | None:
    """(the call's index, its arguments' text in this chunk) of a chat delta that carries a
    piece of one tool call (the first piece names the function; its arguments may be
    empty); ``None`` for any other chunk."""
    calls = tool_calls_of(choice)
    if calls is None or len(calls) != 1 or not isinstance(calls[0], dict):
        return None
    index, function = calls[0].get("index", 0), calls[0].get("function")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    return (index if isinstance(index, int) else 0), (
        arguments if isinstance(arguments, str) else ""
    )


def with_arguments(chunk: dict[str, Any], arguments: str) -> dict[str, Any]:
    """A copy of a tool-call chunk whose call carries ``arguments`` (its id and name, if
    it has them, stay), without finish or logprobs."""
    choice = dict(chunk["choices"][0])
    call = dict(choice["delta"]["tool_calls"][0])
    call["function"] = {**call.get("function", {}), "arguments": arguments}
    choice["delta"] = {**choice["delta"], "tool_calls": [call]}
    choice["finish_reason"] = None
    if choice.get("logprobs") is not None:
        choice["logprobs"] = None
    return {**chunk, "choices": [choice]}


def arguments_chunk(chunk: dict[str, Any], choice: int, call: int, text: str) -> dict[str, Any]:
    """A chunk like ``chunk`` that carries only more arguments of call ``call``."""
    delta = {"tool_calls": [{"index": call, "function": {"arguments": text}}]}
    part = {"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**chunk, "choices": [part]}


def with_text(chunk: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of a stream chunk whose one choice carries ``text`` (and no finish). Its
    logprobs go: they name the chunk's own tokens, which the output filter may be holding
    back (or have blocked)."""
    choice = dict(chunk["choices"][0])
    if "delta" in choice:
        choice["delta"] = {**choice["delta"], "content": text}
    else:
        choice["text"] = text
    choice["finish_reason"] = None
    if choice.get("logprobs") is not None:
        choice["logprobs"] = None
    return {**chunk, "choices": [choice]}


def finished(chunk: dict[str, Any], reason: str) -> dict[str, Any]:
    """A copy of a stream chunk that only ends the choice (no text, no logprobs)."""
    choice = dict(chunk["choices"][0])
    if "delta" in choice:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    choice["finish_reason"] = reason
    if choice.get("logprobs") is not None:
        choice["logprobs"] = None
    return {**chunk, "choices": [choice]}


def numbers(timings: Any) -> dict[str, float]:
    if not isinstance(timings, dict):
        return {}
    return {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}


def answer_text(data: dict[str, Any]) -> str:
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def event_of(payload: str) -> Event:
    """An event's payload with its chunk parsed (``None`` for ``[DONE]``); ValueError when
    the payload is not JSON."""
    return (payload, None) if payload == DONE else (payload, json.loads(payload))


async def read_head_events(lines: SSELines) -> list[Event]:
    """The stream's events up to its first token (or its end), held back so the request
    can still go to another replica if this one fails before producing one. Raises
    StopAsyncIteration if the stream ends without any event."""
    head: list[Event] = []
    while True:
        try:
            line = await lines.line()
        except StopAsyncIteration:
            break
        payload = data_of(line)
        if payload is None:
            continue
        head.append(event := event_of(payload))
        chunk = event[1]
        if chunk is None:  # [DONE]
            return head
        choices = chunk.get("choices") or []
        if "error" in chunk or (
            choices
            and (
                text_of(choices[0]) or tool_calls_of(choices[0]) or choices[0].get("finish_reason")
            )
        ):
            return head
    if not head:
        raise StopAsyncIteration
    return head
