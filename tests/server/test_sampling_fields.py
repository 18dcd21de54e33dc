"""The sampling fields OpenAI and vLLM clients send, through the official openai client on a
real replica: logprobs (chat and completions, whole and streamed), logit_bias, penalties,
min_tokens; fields that change nothing are accepted, and every field that would change the
answer and is not supported is refused with 400 naming it."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from sendpath.server.protocol import UNSUPPORTED
from tests.server.conftest import Server

MESSAGES: Any = [{"role": "user", "content": "Say something about the sea."}]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_are_consistent_with_greedy_choice(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 6
    for entry in logprobs.content:
        top = entry.top_logprobs
        assert len(top) == 5
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
        # greedy: the chosen token is the likeliest one
        assert entry.token == top[0].token and math.isclose(entry.logprob, top[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    text = "".join(e.token for e in logprobs.content)
    assert text == resp.choices[0].message.content


def test_streamed_chat_logprobs_come_with_their_tokens(server: Server) -> None:
    stream = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for entry in chunk.choices[0].logprobs.content
    ]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_logprobs(server: Server) -> None:
    resp = client(server).completions.create(
        model="tiny", prompt="The sea is", max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and math.isclose(max(top.values()), value)
        assert top[token] == value  # greedy: the chosen one is in the top
    assert lp.text_offset == sorted(lp.text_offset)


def test_logit_bias_forces_and_forbids_tokens(server: Server) -> None:
    tokenizer = server.core.tokenizer
    forced = tokenizer.encode(" whale", add_special_tokens=False)[0]
    resp = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].message.content == tokenizer.decode([forced] * 4)
    plain = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0
    )
    first = tokenizer.encode_chat(MESSAGES)  # the greedy first token, then forbidden
    ids = server.core.tokenizer.encode(plain.choices[0].message.content or "x")
    banned = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logit_bias={str(ids[0]): -100},
    )
    assert first and not (banned.choices[0].message.content or "").startswith(
        tokenizer.decode(ids[:1])
    )


def test_penalties_break_a_repetition(server: Server) -> None:
    """A bias makes the tiny model repeat one token; the penalties on repeats end that.
    (Each penalty's arithmetic is checked in tests/model/test_sampler.py.)"""
    token = server.core.tokenizer.encode(" whale", add_special_tokens=False)[0]

    def answer(**fields: Any) -> list[int]:
        resp = client(server).completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=16,
            temperature=0,
            logprobs=0,
            logit_bias={str(token): 16},
            extra_body={"ignore_eos": True, **fields},
        )
        assert resp.choices[0].logprobs is not None
        return [
            server.core.tokenizer.encode(t, add_special_tokens=False)[0]
            for t in resp.choices[0].logprobs.tokens or []
        ]

    assert answer() == [token] * 16  # logits here spread about +-7: +16 always wins
    assert (
        answer(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0) == [token] * 16
    )
    assert answer(frequency_penalty=2.0).count(token) < 16  # 2 a repeat: +16 spent by the 8th
    assert answer(repetition_penalty=100.0).count(token) == 1  # (logit + 16) / 100 after it


def test_min_tokens_holds_off_the_end(server: Server) -> None:
    eos = server.core.tokenizer.eos_token_ids[0]
    resp = client(server).completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logit_bias={str(eos): 100},  # EOS would come first ...
        extra_body={"min_tokens": 3},  # ... but not before three tokens
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert resp.choices[0].finish_reason == "stop"


def test_fields_that_change_nothing_are_accepted(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        user="someone",
        metadata={"a": "b"},
        store=False,
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=False,
    )
    assert resp.choices[0].message.content is not None


ASKING: dict[str, Any] = {  # a value of each unsupported field that asks for something
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "best_of": 2,
    "suffix": "end",
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "web_search_options": {},
    "use_beam_search": True,
    "length_penalty": 2.0,
    "prompt_logprobs": 1,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {}},
    "bad_words": ["sea"],
    "allowed_token_ids": [1, 2],
    "logits_processors": ["x"],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"x": 1},
    "add_generation_prompt": False,
    "continue_final_message": True,
}


def test_asking_values_cover_every_unsupported_field() -> None:
    assert set(ASKING) == set(UNSUPPORTED)


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
@pytest.mark.parametrize("field", sorted(ASKING))
def test_each_unsupported_field_is_refused_by_name(
    server: Server, endpoint: str, field: str
) -> None:
    body: dict[str, Any] = {"model": "tiny", field: ASKING[field]}
    body |= {"messages": MESSAGES} if endpoint == "chat/completions" else {"prompt": "hi"}
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"]
