"""How a model is told about tools and shown the calls it made, through its chat template.

A template that takes ``tools`` (Qwen2.5/3, Llama 3.1, Mistral, Hermes, ...) gets them as
transformers passes them: OpenAI's ``[{"type": "function", "function": {...}}]``, with past
calls as ``tool_calls`` on assistant messages (their arguments as objects) and results as
``tool`` messages. The template also says how the model writes a call, which names the
parser of its answers (``tool_format``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after any text
  (Qwen, Hermes and every template that mentions ``<tool_call>``);
- ``json``: the whole answer is a call object or a list of them, maybe after a marker such
  as Llama 3's ``<|python_tag|>`` or Mistral's ``[TOOL_CALLS]`` (other templates that take
  tools).

A template that takes no tools (SmolLM2's, Llama 2's) learns of them from a system message
written here in the hermes format, past calls are written into the assistant's text in
that format, and tool results come back as user turns wrapped in ``<tool_response>``; its
answers are then parsed as hermes. That is how such a model can call a tool at all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = ["CALL_END", "CALL_START", "ToolFormat", "tool_format", "with_tools_described"]

ToolFormat = Literal["hermes", "json"]
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def tool_format(template: str | None) -> ToolFormat:
    """How answers written under ``template`` call tools (see the module's docstring)."""
    if template is None or CALL_START in template:
        return "hermes"
    return "json"


def _describe(tools: Sequence[Mapping[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. Each function is described as a JSON "
        f"object inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call one, write a JSON object with its name and arguments inside "
        f'{CALL_START}{CALL_END} tags:\n{CALL_START}\n{{"name": "function name", '
        f'"arguments": {{...}}}}\n{CALL_END}\nA function\'s result comes back in '
        "<tool_response></tool_response> tags."
    )


def _written_call(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"{CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_END}"


def with_tools_described(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` for a template that takes no tools: the tools described in the system
    message (one is added first where there is none), past calls written into the
    assistant's text, tool results as user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if calls:
            written = "\n".join(_written_call(c) for c in calls)
            text = message.get("content") or ""
            message["content"] = f"{text}\n{written}" if text else written
        if message["role"] == "tool":
            message = {
                "role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
            }
        message.pop("tool_call_id", None)
        out.append(message)
    if tools:
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": "\n\n".join(filter(None, [first, _describe(tools)]))}
        else:
            out.insert(0, {"role": "system", "content": _describe(tools)})
    return out
