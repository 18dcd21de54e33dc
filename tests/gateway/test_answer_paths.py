"""One answer, two shapes: the same request answered whole and streamed through the
gateway carries the same choices (text, tool calls, logprobs' tokens), finish reasons and
usage, for one choice and for three, with tools, with logprobs, and when the output
filter blocks the answer midway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import regex

from sendpath.gateway.safety import RulesFilter
from tests.gateway.conftest import CHAT, Gateway, gateway
from tests.server.conftest import Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
REQUESTS: dict[str, dict[str, Any]] = {
    "one": {**CHAT, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    "three": {**CHAT, "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 7},
    "logprobs": {
        **CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2,
    },
    "tools": {
        **CHAT, "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
}  # fmt: skip


def whole(gw: Gateway, secret: str, body: dict[str, Any]) -> dict[str, Any]:
    r = gw.post(secret, body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return {
        "choices": [
            {
                "content": c["message"].get("content") or "",
                "tool_calls": [
                    (t["function"]["name"], t["function"]["arguments"])
                    for t in c["message"].get("tool_calls") or []
                ],
                "tokens": [e["token"] for e in (c.get("logprobs") or {}).get("content") or []],
                "finish_reason": c["finish_reason"],
            }
            for c in sorted(answer["choices"], key=lambda c: c["index"])
        ],
        "usage": (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]),
    }


def streamed(gw: Gateway, secret: str, body: dict[str, Any]) -> dict[str, Any]:
    events = gw.stream(secret, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    choices: dict[int, dict[str, Any]] = {}
    calls: dict[tuple[int, int], list[str]] = {}
    usage = None
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("usage"):
            usage = (e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"])
        for c in e.get("choices") or []:
            choice = choices.setdefault(
                c["index"], {"content": "", "tokens": [], "finish_reason": None}
            )
            delta = c["delta"]
            choice["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                parts = calls.setdefault((c["index"], call["index"]), ["", ""])
                parts[0] += call.get("function", {}).get("name") or ""
                parts[1] += call.get("function", {}).get("arguments") or ""
            for entry in (c.get("logprobs") or {}).get("content") or []:
                choice["tokens"].append(entry["token"])
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
    for i, choice in choices.items():
        choice["tool_calls"] = [tuple(v) for k, v in sorted(calls.items()) if k[0] == i]
    return {
        "choices": [
            {k: choices[i][k] for k in ("content", "tool_calls", "tokens", "finish_reason")}
            for i in sorted(choices)
        ],
        "usage": usage,
    }


@pytest.mark.parametrize("name", list(REQUESTS))
def test_whole_and_streamed_carry_the_same_answer(
    name: str, replica: Server, tmp_path: Path
) -> None:
    body = REQUESTS[name]
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("a")
        a, b = whole(gw, secret, body), streamed(gw, secret, body)
    assert a == b
    assert len(a["choices"]) == body.get("n", 1)
    if name == "three":
        assert len({c["content"] for c in a["choices"]}) == 3  # sampled on their own
    if name == "logprobs":
        assert len(a["choices"][0]["tokens"]) == 10
    if name == "tools":
        (call,) = a["choices"][0]["tool_calls"]
        assert call[0] == "get_weather" and a["choices"][0]["finish_reason"] == "tool_calls"


def test_the_output_filter_blocks_both_shapes_alike(replica: Server, tmp_path: Path) -> None:
    body = REQUESTS["one"]
    with gateway(replica, tmp_path / "open", safety=RulesFilter({})) as gw:
        text = whole(gw, gw.key("a"), body)["choices"][0]["content"]
    phrase = text[len(text) // 2 : len(text) // 2 + 4]  # midway through the real answer
    rules = RulesFilter({"test_phrase": [regex.escape(phrase)]})
    with gateway(replica, tmp_path / "guarded", safety=rules) as gw:
        secret = gw.key("a")
        a, b = whole(gw, secret, body), streamed(gw, secret, body)
    for shape in (a, b):
        (choice,) = shape["choices"]
        assert choice["finish_reason"] == "content_filter"
        assert phrase not in choice["content"] and text.startswith(choice["content"])
    assert a["choices"] == b["choices"]  # the same text kept, to the character
    # usage differs for now: the whole answer's is the replica's (every token it made),
    # the blocked stream's the gateway's estimate at the cut (its replica request aborted)


def test_a_blocked_choice_of_several_is_cut_alike_in_both_shapes(
    replica: Server, tmp_path: Path
) -> None:
    body = {**CHAT, "max_tokens": 12, "n": 2, "seed": 5, "temperature": 1.0}
    with gateway(replica, tmp_path / "open", safety=RulesFilter({})) as gw:
        texts = [c["content"] for c in whole(gw, gw.key("a"), body)["choices"]]
    phrase = next(
        texts[1][i : i + 4] for i in range(len(texts[1]) - 4) if texts[1][i : i + 4] not in texts[0]
    )  # in the second answer only
    rules = RulesFilter({"test_phrase": [regex.escape(phrase)]})
    with gateway(replica, tmp_path / "guarded", safety=rules) as gw:
        secret = gw.key("a")
        a, b = whole(gw, secret, body), streamed(gw, secret, body)
    for shape in (a, b):
        first, second = shape["choices"]
        assert first["content"] == texts[0] and first["finish_reason"] == "length"
        assert second["finish_reason"] == "content_filter" and phrase not in second["content"]
    assert a == b  # the other choice goes on to its end; usage is the replica's in both
