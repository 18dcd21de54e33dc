"""Tool calls parsed out of answers: every way a model writes them, streamed in pieces of
every size, gives the same message as the whole answer at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sendpath.model.tool_prompt import ToolFormat
from sendpath.server.tool_calls import CallParser, merge
from sendpath.server.tools import ToolUse

AUTO = ToolUse("auto")


def parsed(
    text: str, use: ToolUse = AUTO, fmt: ToolFormat = "hermes", step: int = 0
) -> tuple[str | None, list[dict[str, Any]] | None, list[dict[str, Any]], CallParser]:
    """The message ``text`` makes, fed whole (step 0) or ``step`` characters at a time."""
    parser = CallParser(use, fmt)
    pieces = [text] if step == 0 else [text[i : i + step] for i in range(0, len(text), step)]
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.end()
    content, calls = merge(deltas)
    return content, calls, deltas, parser


def named_calls(calls: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
    assert calls is not None
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def same_in_every_step(text: str, use: ToolUse = AUTO, fmt: ToolFormat = "hermes") -> Any:
    """The message, after checking every piece size gives the same one (ids aside)."""
    content, calls, _, _ = parsed(text, use, fmt)
    for step in range(1, len(text) + 1):
        c, k, _, _ = parsed(text, use, fmt, step)
        assert c == content, step
        assert (k and named_calls(k)) == (calls and named_calls(calls)), step
    return content, calls


HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def test_hermes_calls_after_text() -> None:
    content, calls = same_in_every_step(HERMES)
    assert content == "Let me look.\n"
    assert named_calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_an_answer_of_calls_only_has_no_content_and_finishes_with_tool_calls() -> None:
    content, calls, _, parser = parsed('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert content is None and named_calls(calls) == [("f", {})]
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_streamed_deltas_are_openais() -> None:
    _, _, deltas, _ = parsed(HERMES, step=3)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, args = calls[0], calls[1]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert calls[2]["index"] == 1


def test_text_that_only_looks_like_a_tag_is_content() -> None:
    for text in ("a <tool b", "x <tool_cal", "1 < 2 and <tool_call is not a tag"):
        content, calls = same_in_every_step(text)
        assert content == text and calls is None


def test_a_call_that_does_not_parse_is_given_back_as_written() -> None:
    text = "Sure <tool_call>{not json}</tool_call>"
    content, calls = same_in_every_step(text)
    assert content == text and calls is None
    cut = 'Sure <tool_call>{"name": "f", "argu'  # the answer ran out of tokens mid-call
    content, calls, _, parser = parsed(cut)
    assert content == cut and calls is None and parser.finish_reason("length") == "length"


def test_an_unclosed_but_whole_call_still_counts() -> None:
    content, calls = same_in_every_step('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content is None and named_calls(calls) == [("f", {"a": 1})]


def test_arguments_written_as_a_string_pass_through() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = same_in_every_step(text)
    assert named_calls(calls) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '  {"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_json_format_calls(text: str) -> None:
    content, calls = same_in_every_step(text, fmt="json")
    assert content is None and named_calls(calls) == [("get_weather", {"city": "Paris"})]


def test_json_format_text_and_json_that_is_not_a_call_are_content() -> None:
    for text in ("The weather is fine.", '{"answer": 42}', "[1, 2]", " [TOOL"):
        content, calls = same_in_every_step(text, fmt="json")
        assert content == text and calls is None


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    use = ToolUse("named", "get_weather")
    parser = CallParser(use, "hermes")
    first = parser.feed('{"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"ci'}
    rest = parser.feed('ty": "Paris"}') + parser.end()
    assert rest == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]
    content, calls = merge(first + rest)
    assert content is None and named_calls(calls) == [("get_weather", {"city": "Paris"})]
    assert parser.finish_reason("stop") == "tool_calls"


def test_required_calls_are_the_constrained_list() -> None:
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    content, calls = same_in_every_step(text, ToolUse("required"))
    assert content is None and named_calls(calls) == [("f", {"a": 1}), ("g", {})]
    content, calls, _, _ = parsed('[{"name": "f", "param', ToolUse("required"))
    assert content == '[{"name": "f", "param' and calls is None  # cut short: as written
