"""The output filter over an answer's choices, for whole and streamed answers alike.

Each choice's text has its own ``OutputGuard``, and so has each of its tool calls'
arguments (a phrase is looked for within one text; the choices of an ``n > 1`` answer,
and the calls of one choice, are judged apart). A choice whose text or any call's
arguments would be blocked is blocked: it keeps the text released before the phrase,
loses its calls and logprobs, and finishes with ``content_filter``; the other choices go
on. A whole answer is judged as one piece of text per choice and per call
(``whole_choice``); a stream as its pieces arrive (``text``, ``arguments``, then
``rest`` and ``call_rests`` at its finish). Both release the same text: a guard pushed a
text whole and the same text in pieces releases the same (``OutputGuard.push``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sendpath.gateway.chunks import index_of
from sendpath.gateway.safety import OutputGuard

__all__ = ["ChoiceFilter"]

TEXT = -1  # the call number of a choice's own text


class ChoiceFilter:
    """One answer's guards, made on each text's first piece."""

    def __init__(self, new_guard: Callable[[], OutputGuard]) -> None:
        self.new_guard = new_guard
        self.guards: dict[tuple[int, int], OutputGuard] = {}  # (choice, call or TEXT)
        self.blocked: set[int] = set()  # the choices blocked so far

    def _guard(self, choice: int, call: int) -> OutputGuard:
        guard = self.guards.get((choice, call))
        if guard is None:
            guard = self.guards[choice, call] = self.new_guard()
        return guard

    def _pushed(self, choice: int, call: int, text: str) -> str:
        guard = self._guard(choice, call)
        released = guard.push(text)
        if guard.blocked is not None:
            self.blocked.add(choice)
        return released

    def text(self, choice: int, text: str) -> str:
        """What of a piece of choice ``choice``'s text goes out now. When it blocks the
        choice (``choice in blocked`` after it): the text before where the phrase could
        start, which goes out before the choice's ``content_filter`` finish."""
        return self._pushed(choice, TEXT, text)

    def texts(self, choice: int, texts: Sequence[str]) -> list[str] | None:
        """Several pieces of one choice's text that arrived together, judged as one
        (``OutputGuard.push_each``); ``None``, with nothing changed, when they would block
        it (then ``text`` each on its own)."""
        return self._guard(choice, TEXT).push_each(texts)

    def arguments(self, choice: int, call: int, text: str) -> str:
        """What of a piece of a tool call's arguments goes out now (blocked: "")."""
        released = self._pushed(choice, call, text)
        return "" if choice in self.blocked else released

    def rest(self, choice: int) -> str:
        """At the choice's finish: what its text's guard still holds, if it passes."""
        guard = self.guards.get((choice, TEXT))
        return guard.flush() if guard is not None else ""

    def call_rests(self, choice: int) -> list[tuple[int, str]]:
        """At the choice's finish: (call, text) of what its calls' guards still hold."""
        out = []
        for (c, call), guard in self.guards.items():
            rest = guard.flush() if c == choice and call != TEXT else ""
            if rest:
                out.append((call, rest))
        return out

    def whole_choice(self, choice: dict[str, Any]) -> None:
        """Judge a whole answer's choice (a chat ``message`` or a completion's ``text``),
        and rewrite it in place if it is blocked (module docstring)."""
        index = index_of(choice)
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        released = ""
        if isinstance(text, str):
            released = self.text(index, text)
            released += "" if index in self.blocked else self.rest(index)
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call, part in enumerate(calls if isinstance(calls, list) else []):
            function = part.get("function") if isinstance(part, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str) and index not in self.blocked:
                self.arguments(index, call, arguments)
        if index not in self.blocked:
            return
        if isinstance(message, dict):
            message["content"] = released
            message.pop("tool_calls", None)
        else:
            choice["text"] = released
        choice["finish_reason"] = "content_filter"
        choice["logprobs"] = None  # they spell out the blocked text
