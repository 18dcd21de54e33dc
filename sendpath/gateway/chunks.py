"""OpenAI stream chunks as the gateway reads and rewrites them (torch-free helpers)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["answer_text", "chain", "finished", "numbers", "read_head", "text_of", "with_text"]


def text_of(choice: dict[str, Any]) -> str | None:
    if "delta" in choice:
        content = choice["delta"].get("content")
        return content if isinstance(content, str) else None
    text = choice.get("text")
    return text if isinstance(text, str) else None


def with_text(chunk: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of a stream chunk whose one choice carries ``text`` (and no finish)."""
    choice = dict(chunk["choices"][0])
    if "delta" in choice:
        choice["delta"] = {**choice["delta"], "content": text}
    else:
        choice["text"] = text
    choice["finish_reason"] = None
    return {**chunk, "choices": [choice]}


def finished(chunk: dict[str, Any], reason: str) -> dict[str, Any]:
    choice = dict(chunk["choices"][0])
    if "delta" in choice:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    choice["finish_reason"] = reason
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


async def read_head(lines: AsyncIterator[str]) -> list[str]:
    """The stream's events up to its first token (or its end), held back so the request
    can still go to another replica if this one fails before producing one. Raises
    StopAsyncIteration if the stream ends without any event."""
    head: list[str] = []
    async for line in lines:
        if not line.startswith("data:"):
            continue
        head.append(line)
        payload = line[5:].strip()
        if payload == "[DONE]":
            return head
        event = json.loads(payload)
        choices = event.get("choices") or []
        if "error" in event or (
            choices and (text_of(choices[0]) or choices[0].get("finish_reason"))
        ):
            return head
    if not head:
        raise StopAsyncIteration
    return head


async def chain(head: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for line in head:
        yield line
    async for line in rest:
        yield line
