"""A chat request's tools: the prompt that shows them, and how its answer may call them.

OpenAI's ``tool_choice``:

- ``none``: the tools are left out of the prompt and the answer is text;
- ``auto`` (the default with tools): the tools go through the chat template, and calls
  the model writes in its own format are parsed out of its answer (``tool_calls``);
- ``required``: the answer is constrained (the same grammar engine as ``response_format``)
  to a JSON list of one or more ``{"name", "parameters"}`` objects, one per call, each
  naming a listed function and matching its parameters' schema (vLLM's form);
- a named function: the answer is constrained to that function's arguments object.

Past calls (an assistant's ``tool_calls``) and their results (``tool`` messages) are
rendered as the template expects them, arguments as objects (as transformers passes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from sendpath.api.schema import ChatBody, Message, NamedTool, Tool, content_text
from sendpath.errors import InvalidRequestError
from sendpath.model.tokenizer import Chat
from sendpath.request import StructuredOutput

__all__ = ["ToolUse", "chat_messages", "chat_prompt", "template_tools", "tool_use"]


@dataclass(frozen=True)
class ToolUse:
    """How one chat answer may call tools: ``auto`` (parsed from the model's own format),
    ``required`` (a constrained list of calls) or ``named`` (constrained arguments of
    ``name``)."""

    mode: Literal["auto", "required", "named"]
    name: str | None = None


def _template_message(i: int, message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": content_text(message.content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments, i, j),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    return out


def _arguments(text: str, i: int, j: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "A tool call's arguments must be a JSON object written as a string, "
            'e.g. "{\\"city\\": \\"Paris\\"}".',
            param=f"messages.{i}.tool_calls.{j}.function.arguments",
        )
    return value


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them."""
    return [_template_message(i, m) for i, m in enumerate(messages)]


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """``tools`` as a chat template reads them (OpenAI's objects, as transformers passes)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def chat_prompt(body: ChatBody) -> Chat:
    """The engine's prompt: the messages, with the tools unless ``tool_choice`` is none."""
    tools = template_tools(body.tools) if body.tools and body.tool_choice != "none" else None
    return Chat(chat_messages(body.messages), tools)


def tool_use(body: ChatBody, json_output: bool) -> tuple[ToolUse | None, StructuredOutput | None]:
    """How the answer may call tools, and the constraint that makes it (required, named);
    ``json_output``: the request also asks for JSON through ``response_format``."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice needs tools: list the functions the model may call in 'tools'.",
                param="tool_choice",
            )
        return None, None
    if choice == "none":
        return None, None
    if choice is None or choice == "auto":
        # an answer constrained to response_format's JSON cannot also write calls
        return (None if json_output else ToolUse("auto")), None
    if json_output:
        raise InvalidRequestError(
            "tool_choice that forces a call cannot go with response_format's JSON: "
            "the answer is the call. Leave one of them out.",
            param="tool_choice",
        )
    functions = {t.function.name: t.function for t in body.tools}
    if isinstance(choice, NamedTool):
        function = functions.get(choice.function.name)
        if function is None:
            raise InvalidRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not "
                f"in tools ({', '.join(sorted(functions))}).",
                param="tool_choice.function.name",
            )
        return ToolUse("named", function.name), StructuredOutput(
            _parameters(function.parameters), "tools"
        )
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "parameters": _parameters(function.parameters),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, function in functions.items()
            ]
        },
    }
    if not body.parallel_tool_calls:
        calls["maxItems"] = 1
    return ToolUse("required"), StructuredOutput(calls, "tools")


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema; none given means any object (OpenAI's reading)."""
    return schema if schema else {"type": "object"}
