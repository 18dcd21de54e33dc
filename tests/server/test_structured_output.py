"""JSON answers on request (OpenAI's response_format) through the official openai client,
unmodified: ``chat.completions.parse`` with a Pydantic model gets a parsed object, from the
tiny random model (whatever it says, it is valid JSON of that shape) and from the built-in
model (which knows the answer); json_object, streaming, and bad schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from sendpath.llm import LLM
from tests.server.conftest import Server, serve


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    label: str = Field(max_length=12)
    count: int = Field(ge=0, le=99)


class Capital(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def builtin(builtin_llm: LLM) -> Iterator[Server]:
    with serve(builtin_llm.loaded) as s:
        yield s


def test_parse_gives_the_pydantic_object_even_from_a_random_model(server: Server) -> None:
    for seed in range(3):  # sampled, not greedy: different valid answers
        resp = client(server).chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Pick a color."}],
            response_format=Pick,
            max_tokens=200,
            seed=seed,
        )
        picked = resp.choices[0].message.parsed
        assert isinstance(picked, Pick), resp.choices[0].message.content
        assert resp.choices[0].finish_reason == "stop"


def test_the_built_in_model_answers_tokyo_as_json(builtin: Server) -> None:
    resp = client(builtin).chat.completions.parse(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": "What is the capital of Japan? Answer in JSON with city and country.",
            }
        ],
        response_format=Capital,
        temperature=0,
        max_tokens=60,
    )
    capital = resp.choices[0].message.parsed
    assert isinstance(capital, Capital) and capital.city == "Tokyo"


def test_json_object_and_streaming(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Anything, as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=1,
        extra_body={"logit_bias": {}},
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    else:  # a random model may write a long object: what there is must still be JSON so far
        assert (resp.choices[0].message.content or "").startswith("{")
    strict = {**Pick.model_json_schema(), "additionalProperties": False}  # as parse() sends
    schema: Any = {
        "type": "json_schema",
        "json_schema": {"name": "pick", "schema": strict, "strict": True},
    }
    stream = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Pick a color."}],
        response_format=schema,
        max_tokens=200,
        seed=5,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Pick.model_validate_json(text)


@pytest.mark.parametrize(
    ("response_format", "param", "text"),
    [
        ({"type": "json_schema"}, "response_format.json_schema", "needs its json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            "response_format",
            "cannot be used",
        ),
        ({"type": "yaml"}, "response_format.type", "Invalid value"),
    ],
)
def test_bad_formats_are_400_naming_the_field(
    server: Server, response_format: Any, param: str, text: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "response_format": response_format}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_ignore_eos_cannot_go_with_json(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
            "ignore_eos": True,
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
