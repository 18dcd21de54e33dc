"""The text a generation request puts before the model, read one way everywhere.

A chat's text is its messages' texts (each message's parts joined with nothing between:
``schema.content_text``, as the replica renders them, then the name and arguments of each
tool call it made), one message a line, after its tools' definitions where the prompt
shows them (``tool_choice`` other than none); a completion's is its prompt (a one-item
list of text is that item). All of it reaches the model, so a filter reads all of it. A
prompt of token ids has no text here (no tokenizer). The gateway's input filter and token
estimates read ``prompt_text``;
the router's prefix view (``route_text``) is the same texts, each after its role, so both
see one prompt.
"""

from __future__ import annotations

import json

from sendpath.api.schema import ChatBody, CompletionBody, Message, content_text

__all__ = ["message_texts", "prompt_text", "route_text", "tools_text"]

GenerationBody = ChatBody | CompletionBody


def _message_text(message: Message) -> str:
    calls = [f"{c.function.name} {c.function.arguments}" for c in message.tool_calls or []]
    return "\n".join([content_text(message.content), *calls])


def tools_text(request: ChatBody) -> str | None:
    """The definitions of the tools the prompt shows (None: it shows none)."""
    if not request.tools or request.tool_choice == "none":
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in request.tools]
    return json.dumps(functions, ensure_ascii=False)


def message_texts(request: GenerationBody) -> list[str] | None:
    """Each message's text, after the tools' definitions where the prompt shows them (a
    completion: its prompt, as one); ``None`` for token ids."""
    if isinstance(request, ChatBody):
        tools = tools_text(request)
        texts = [_message_text(m) for m in request.messages]
        return texts if tools is None else [tools, *texts]
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return ["\n".join(str(p) for p in prompt)]
    return None


def prompt_text(request: GenerationBody) -> str | None:
    """The request's text, a message a line (``None``: a prompt of token ids)."""
    texts = message_texts(request)
    return None if texts is None else "\n".join(texts)


def route_text(request: GenerationBody) -> str:
    """What a prefix-aware router hashes: a chat's messages as ``role\\ntext\\n`` each (the
    next turn starts with this one's), a completion's prompt, or its token ids spelled out."""
    if isinstance(request, ChatBody):
        tools = tools_text(request)
        turns = "".join(f"{m.role}\n{_message_text(m)}\n" for m in request.messages)
        return turns if tools is None else f"tools\n{tools}\n{turns}"
    texts = message_texts(request)
    if texts is None:
        return " ".join(str(p) for p in request.prompt)
    return texts[0]
