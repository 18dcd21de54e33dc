"""Tools and past tool calls in the prompt: rendered through a template that takes them
exactly as transformers renders them (Qwen2.5's and Llama 3.1's real templates), and
described in the messages for a template that does not (the built-in SmolLM2's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sendpath.model.tokenizer import Tokenizer
from sendpath.model.tool_prompt import tool_format

TEMPLATES = Path(__file__).parent / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "c": 21}'},
]


def with_template(tokenizer: Tokenizer, name: str) -> Tokenizer:
    return dataclasses.replace(tokenizer, chat_template=(TEMPLATES / name).read_text())


@pytest.mark.parametrize("name", ["qwen2.5-instruct.jinja", "llama-3.1-instruct.jinja"])
def test_a_template_that_takes_tools_renders_as_transformers_does(
    smol_tokenizer: Tokenizer, name: str
) -> None:
    transformers = pytest.importorskip("transformers")
    ours = with_template(smol_tokenizer, name)
    assert ours.takes_tools
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=smol_tokenizer.backend,
        chat_template=ours.chat_template,
        bos_token=smol_tokenizer.bos_token,
        eos_token=smol_tokenizer.eos_token,
    )
    expected = reference.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    text = ours.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert text == expected
    assert '"get_weather"' in text and "clear" in text  # the tools, the call's result


def test_the_call_format_comes_from_the_template(smol_tokenizer: Tokenizer) -> None:
    assert tool_format(with_template(smol_tokenizer, "qwen2.5-instruct.jinja").chat_template) == (
        "hermes"
    )
    assert tool_format(with_template(smol_tokenizer, "llama-3.1-instruct.jinja").chat_template) == (
        "json"
    )
    assert not smol_tokenizer.takes_tools


def test_a_template_without_tools_gets_them_described(smol_tokenizer: Tokenizer) -> None:
    text = smol_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '{"name": "get_weather", "description": "The weather in a city now."' in system
    assert "<tool_call>" in system  # how to write a call
    # the past call in the assistant's turn, the result as the user's next turn
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"sky": "clear", "c": 21}\n</tool_response><|im_end|>'
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_without_a_system_message_one_is_added_for_the_tools(smol_tokenizer: Tokenizer) -> None:
    text = smol_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert "You are a helpful AI assistant named SmolLM" not in text
