"""The output filter over choices: a text judged whole and the same text in pieces release
the same; each choice, and each tool call, is judged on its own."""

from __future__ import annotations

from typing import Any

from sendpath.gateway.output_filter import ChoiceFilter
from sendpath.gateway.safety import OutputGuard, RulesFilter

RULES = RulesFilter({"spoilers": ["the butler did it"]})


def new() -> ChoiceFilter:
    return ChoiceFilter(lambda: OutputGuard(RULES))


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_whole_and_pieces_release_the_same() -> None:
    for text in ("Spoiler: the butler did it, in the hall.", "The butler came home."):
        whole: dict[str, Any] = {"index": 0, "message": {"content": text}, "finish_reason": "stop"}
        new().whole_choice(whole)
        for size in (1, 3, 7):
            streamed = new()
            out = "".join(streamed.text(0, p) for p in pieces(text, size))
            out += "" if 0 in streamed.blocked else streamed.rest(0)
            assert out == whole["message"]["content"]


def test_a_blocked_choice_keeps_what_came_before_and_loses_calls_and_logprobs() -> None:
    choice: dict[str, Any] = {
        "index": 1,
        "message": {"content": "Well: the butler did it.", "tool_calls": [{"id": "x"}]},
        "logprobs": {"content": []},
        "finish_reason": "tool_calls",
    }
    judge = new()
    judge.whole_choice(choice)
    assert judge.blocked == {1}
    assert choice["message"] == {"content": "Well: "}
    assert choice["finish_reason"] == "content_filter" and choice["logprobs"] is None


def test_choices_and_calls_are_judged_apart() -> None:
    judge = new()
    assert judge.text(0, "the butler ") == ""  # could still become the phrase: held
    assert judge.text(1, "did it.") == "did it."  # another choice: no phrase across them
    assert judge.arguments(0, 0, '{"who": "the butler did it"}') == ""
    assert judge.blocked == {0}
    assert judge.arguments(0, 1, "{}") == ""  # a blocked choice releases nothing more
    assert judge.rest(1) == "" and judge.call_rests(1) == []
    completion = {"index": 0, "text": "fine text", "finish_reason": "length"}
    new().whole_choice(completion)
    assert completion["text"] == "fine text" and completion["finish_reason"] == "length"
