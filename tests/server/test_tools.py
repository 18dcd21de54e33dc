"""Tools through the official openai client, unmodified: a call, the tool's result, a final
answer. On a tiny random model with Qwen2.5's real chat template (a tool-capable template:
the tools and the result must reach the prompt as Qwen writes them) and on the built-in
model (its template takes no tools: sendpath describes them), with tool_choice forcing
calls through constrained decoding; streamed calls arrive as OpenAI streams them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sendpath.llm import LLM
from sendpath.model.loader import LoadedModel
from tests.server.conftest import Server, serve

QWEN_TEMPLATE = Path(__file__).parents[1] / "model" / "templates" / "qwen2.5-instruct.jinja"

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]
RESULT = json.dumps({"temperature_c": 21, "sky": "clear"})


def client(server: Server) -> Any:  # the SDK's typed params are not the point here
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen(tiny: LoadedModel) -> Iterator[Server]:
    tokenizer = dataclasses.replace(tiny.tokenizer, chat_template=QWEN_TEMPLATE.read_text())
    with serve(dataclasses.replace(tiny, tokenizer=tokenizer)) as s:
        yield s


@pytest.fixture(scope="module")
def builtin(builtin_llm: LLM) -> Iterator[Server]:
    with serve(builtin_llm.loaded) as s:
        yield s


def weather_args(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 20
    return dict(args)


def after_call(message: Any) -> Any:
    """The conversation with the assistant's call and the tool's result."""
    call = message.tool_calls[0]
    return [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]


def test_round_trip_on_a_tool_capable_template(qwen: Server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client(qwen).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=60, seed=3
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    weather_args(choice.message.tool_calls[0])
    messages = after_call(choice.message)
    final = client(qwen).chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=8, seed=3
    )
    assert final.choices[0].message.tool_calls is None  # a random model writes no call
    assert isinstance(final.choices[0].message.content, str)
    # what the model read: Qwen's own rendering of the tools, its call and the result
    ids = httpx.post(
        f"{qwen.url}/tokenize", json={"messages": messages, "tools": [WEATHER, TIME]}
    ).json()["tokens"]
    prompt = httpx.post(f"{qwen.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt
    # as Qwen's template writes them: JSON, with any character as itself
    args = json.dumps(
        json.loads(choice.message.tool_calls[0].function.arguments), ensure_ascii=False
    )
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in prompt
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>" in prompt
    assert final.usage.prompt_tokens == len(ids)
    assert qwen.idle()


def test_required_calls_listed_functions_only(qwen: Server) -> None:
    for seed in range(4):
        resp = client(qwen).chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            seed=seed,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        if call.function.name == "get_time":
            assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        else:
            weather_args(call)


def test_a_streamed_call_is_the_whole_one_in_pieces(qwen: Server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=60, seed=5
    )
    whole = client(qwen).chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    pieces: list[Any] = []
    finish = None
    for chunk in client(qwen).chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].index == 0
    assert len(pieces) > 2  # the arguments came in several deltas, as they were written
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments


def test_tool_choice_none_leaves_the_tools_out(qwen: Server) -> None:
    body: dict[str, Any] = {"messages": ASK, "tools": [WEATHER]}
    with_tools = httpx.post(f"{qwen.url}/tokenize", json=body).json()["count"]
    resp = client(qwen).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    without = httpx.post(f"{qwen.url}/tokenize", json={"messages": ASK}).json()["count"]
    assert resp.usage.prompt_tokens == without < with_tools
    assert resp.choices[0].message.tool_calls is None


def test_the_built_in_model_calls_the_tool_then_answers(builtin: Server) -> None:
    resp = client(builtin).chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert weather_args(choice.message.tool_calls[0]) == {"city": "Paris"}  # it knows which
    final = client(builtin).chat.completions.create(
        model="tiny",
        messages=after_call(choice.message),
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
    )
    # SmolLM2-135M was not trained to call tools: left to itself it answers in text
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert answer.message.content


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
    ],
)
def test_mistakes_are_400_naming_the_field(
    qwen: Server, change: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **change}
    resp = httpx.post(f"{qwen.url}/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"].startswith(param), error
    assert qwen.idle()


def test_a_bad_parameters_schema_is_400(qwen: Server) -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    body = {"model": "tiny", "messages": ASK, "tools": [bad], "tool_choice": "required"}
    resp = httpx.post(f"{qwen.url}/v1/chat/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
