"""Tool calls parsed out of an answer as it streams: OpenAI's ``tool_calls`` deltas.

A ``CallParser`` takes one answer's text deltas and gives OpenAI's chat deltas: ``{"content":
...}`` for text, and per call first ``{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments": ""}}]}`` then its arguments (``{"tool_calls": [{"index", "function":
{"arguments": ...}}]}``), as OpenAI streams them. A whole answer is the same deltas merged
(``merge``), so streamed and whole answers never differ.

How calls are written (``server.tools.ToolUse``, ``model.tool_prompt.ToolFormat``):

- auto, hermes: text streams until ``<tool_call>``; a call is held until its
  ``</tool_call>`` (or the answer's end) and then parsed; text after the first call is not
  content (vLLM's reading). Text that could be the start of the tag is held back a moment.
- auto, json: an answer that starts with ``{`` or ``[`` (after ``<|python_tag|>`` or
  ``[TOOL_CALLS]``) is held to its end and parsed as calls; any other answer is content.
- named: the whole answer is the arguments, streamed as it comes.
- required: the answer is a JSON list of ``{"name", "parameters"}``, parsed at its end.

Something that fails to parse as a call is given back as content, as written.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from sendpath.model.tokenizer import Tokenizer
from sendpath.model.tool_prompt import CALL_END, CALL_START, ToolFormat, tool_format
from sendpath.server.tools import ToolUse

__all__ = ["CallParser", "merge", "parser_for"]

_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")  # what precedes a json-format call


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _calls_in(value: Any) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a parsed value, or None if it is not calls
    (the arguments under ``arguments``, or ``parameters`` as Llama 3.1 and ``required``'s
    constraint write them)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            calls.append((item["name"], args))
        elif isinstance(args, dict):
            calls.append((item["name"], json.dumps(args, ensure_ascii=False)))
        else:
            return None
    return calls or None


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class CallParser:
    """One answer's text deltas -> OpenAI chat deltas (see the module's docstring)."""

    def __init__(self, use: ToolUse, fmt: ToolFormat) -> None:
        self.use, self.format = use, fmt
        self.calls = 0  # calls given so far
        self._pending = ""  # text not yet given out
        self._state = "start"  # start, call, after (hermes); start, content, hold (json)
        self._lead = ""  # whitespace before any content: an answer of calls only has none
        self._content_sent = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes (maybe none: it may be held back)."""
        if self.use.mode == "named":
            return self._named(text)
        self._pending += text
        if self.use.mode == "required" or self._state == "hold":
            return []
        if self.format == "json":
            return self._json()
        return self._hermes()

    def step(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The deltas of one engine output's ``text`` (and, on the ``last``, all still held)."""
        return self.feed(text) + self.end() if last else self.feed(text)

    def end(self) -> list[dict[str, Any]]:
        """The deltas still held when the answer ends."""
        pending, self._pending = self._pending, ""
        if self.use.mode == "named":
            out = [] if self.calls else self._call(self.use.name or "", "{}")
        elif self.use.mode == "required":
            out = self._calls_or_text(_calls_in(_parsed(pending)), pending)
        elif self._state == "call":  # hermes, the answer ended inside a call
            body = pending.removesuffix(CALL_END)
            out = self._calls_or_text(_calls_in(_parsed(body)), CALL_START + pending)
        elif self._state == "hold":  # json
            out = self._calls_or_text(_calls_in(_parsed(_after_marker(pending))), pending)
        elif self._state == "after":
            out = []  # text after a hermes call is not content
        else:
            out = self._content(pending)  # held back, but not a call after all
        if self._lead and not self.calls:
            out.append({"content": self._lead})
        return out

    def finish_reason(self, reason: str) -> str:
        """The choice's finish_reason: ``tool_calls`` when it called and stopped itself."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _named(self, text: str) -> list[dict[str, Any]]:
        if not self.calls:
            return self._call(self.use.name or "", text)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _hermes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self._state != "call":
                at = self._pending.find(CALL_START)
                if at < 0:
                    if self._state == "start":
                        keep = len(self._pending) - _held_tail(self._pending, CALL_START)
                        out += self._content(self._pending[:keep])
                        self._pending = self._pending[keep:]
                    return out
                if self._state == "start":
                    out += self._content(self._pending[:at])
                self._pending, self._state = self._pending[at + len(CALL_START) :], "call"
            end = self._pending.find(CALL_END)
            if end < 0:
                return out
            body, self._pending = self._pending[:end], self._pending[end + len(CALL_END) :]
            out += self._calls_or_text(_calls_in(_parsed(body)), CALL_START + body + CALL_END)
            self._state = "after"

    def _json(self) -> list[dict[str, Any]]:
        if self._state == "start":
            head = self._pending.lstrip()
            if not head or any(m.startswith(head) and m != head for m in _MARKERS):
                return []  # too early to tell
            body = _after_marker(self._pending)
            if not body:
                return []  # a marker: its call is still to come
            self._state = "hold" if body[0] in "{[" else "content"
            if self._state == "hold":
                return []
        text, self._pending = self._pending, ""
        return self._content(text)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not self._content_sent:
            if not text.strip():
                self._lead += text
                return []
            text, self._lead, self._content_sent = self._lead + text, "", True
        return [{"content": text}] if text else []

    def _calls_or_text(
        self, calls: list[tuple[str, str]] | None, text: str
    ) -> list[dict[str, Any]]:
        if not calls:
            return self._content(text)
        out: list[dict[str, Any]] = []
        for name, arguments in calls:
            out += self._call(name, arguments)
        return out

    def _call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        index, self.calls = self.calls, self.calls + 1
        head = {"index": index, "id": call_id(), "type": "function"}
        out: list[dict[str, Any]] = [
            {"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]}
        ]
        if arguments:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        return out


def parser_for(use: ToolUse | None, tokenizer: Tokenizer) -> CallParser | None:
    """A parser for one answer of a request that may call tools (None: it may not)."""
    if use is None:
        return None
    return CallParser(use, tool_format(tokenizer.chat_template if tokenizer.takes_tools else None))


def _after_marker(text: str) -> str:
    """``text`` without leading space and a json-format call's marker."""
    text = text.lstrip()
    for marker in _MARKERS:
        if text.startswith(marker):
            return text[len(marker) :].lstrip()
    return text


def merge(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole message's ``content`` and ``tool_calls`` from its deltas."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for part in delta.get("tool_calls", []):
            if "id" in part:
                function = dict(part["function"])
                calls.append({"id": part["id"], "type": "function", "function": function})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    text = "".join(content)
    return (text if text or not calls else None), (calls or None)
