"""n answers to one prompt (``server/fanout.py``, answered by ``server/generate.py``)
through the official openai client: each choice sampled on its own (seed + i), the same n
again for the same seed, whole and streamed alike, usage counting the prompt once, the
prompt's blocks computed once."""

from __future__ import annotations

import json
from typing import Any

import openai

from tests.server.conftest import Server

MESSAGES: Any = [
    {"role": "user", "content": "Tell me a story about the sea, its waves and the wind."}
]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_seeded_choices_differ_and_repeat(server: Server) -> None:
    def ask() -> list[str]:
        resp = client(server).chat.completions.create(
            model="tiny", messages=MESSAGES, n=3, seed=11, max_tokens=8
        )
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert resp.usage is not None and resp.usage.completion_tokens == 24
        assert resp.usage.prompt_tokens == len(server.core.tokenizer.encode_chat(MESSAGES))
        return [c.message.content or "" for c in resp.choices]

    first = ask()
    assert len(set(first)) == 3 and ask() == first
    single = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, seed=11, max_tokens=8
    )
    assert single.choices[0].message.content == first[0]  # choice 0 is the request alone


def test_streamed_choices_are_the_whole_ones(server: Server) -> None:
    whole = client(server).completions.create(
        model="tiny", prompt="The sea is", n=2, seed=3, max_tokens=6, logprobs=1
    )
    stream = client(server).completions.create(
        model="tiny",
        prompt="The sea is",
        n=2,
        seed=3,
        max_tokens=6,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = ["", ""], None
    finishes: list[str | None] = [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert finishes == ["length", "length"] and usage is not None
    assert usage.completion_tokens == 12
    for choice in whole.choices:
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 6


def test_the_prompt_is_computed_once(server: Server) -> None:
    before = server.core.stats().prefix_cache_hits
    prompt = list(range(1000, 1000 + 100))  # 100 fresh tokens: 6 full blocks of 16
    resp = client(server).completions.create(model="tiny", prompt=prompt, n=4, max_tokens=2)
    assert len(resp.choices) == 4
    # choices 1-3 found the prompt's 6 full blocks (96 tokens) that choice 0 computed
    assert server.core.stats().prefix_cache_hits - before >= 3 * 96
    assert server.idle()


def test_greedy_choices_are_the_same_answer(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, n=2, temperature=0, max_tokens=6
    )
    assert resp.choices[0].message.content == resp.choices[1].message.content


def test_another_models_name_is_404_before_any_choice_runs(server: Server) -> None:
    # (the fuzzer found n > 1 answering for any model name, up to the context's end)
    for stream in (False, True):
        try:
            client(server).completions.create(
                model="not-served", prompt="hello", n=57, stream=stream
            )
            raise AssertionError("answered for a model it does not serve")
        except openai.NotFoundError as exc:
            assert "not-served" in str(exc)
    assert server.idle()


def test_choices_of_a_tool_call_are_parsed_each_on_its_own(server: Server) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                # a few values: a random model's integer could run past max_tokens
                "properties": {"n": {"type": "integer", "enum": [1, 2, 3, 10, 20, 30]}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    named: Any = {"type": "function", "function": {"name": "pick"}}
    kwargs: Any = dict(
        model="tiny", messages=MESSAGES, tools=[tool], tool_choice=named, n=3, seed=2, max_tokens=12
    )
    whole = client(server).chat.completions.create(**kwargs)
    calls = {c.index: c.message.tool_calls[0].function.arguments for c in whole.choices}
    assert all(c.finish_reason == "tool_calls" for c in whole.choices)
    assert all(set(json.loads(a)) == {"n"} for a in calls.values())
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client(server).chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or []:
                streamed[choice.index] += part.function.arguments or ""
    assert streamed == calls
