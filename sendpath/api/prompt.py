"""The text a generation request puts before the model, read one way everywhere.

A chat's text is its messages' texts (each message's parts joined with nothing between:
``schema.content_text``, as the replica renders them), one message a line; a completion's
is its prompt (a one-item list of text is that item). A prompt of token ids has no text
here (no tokenizer). The gateway's input filter and token estimates read ``prompt_text``;
the router's prefix view (``route_text``) is the same texts, each after its role, so both
see one prompt.
"""

from __future__ import annotations

from sendpath.api.schema import ChatBody, CompletionBody, content_text

__all__ = ["message_texts", "prompt_text", "route_text"]

GenerationBody = ChatBody | CompletionBody


def message_texts(request: GenerationBody) -> list[str] | None:
    """Each message's text (a completion: its prompt, as one); ``None`` for token ids."""
    if isinstance(request, ChatBody):
        return [content_text(m.content) for m in request.messages]
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
    texts = message_texts(request)
    if isinstance(request, ChatBody):
        assert texts is not None
        return "".join(f"{m.role}\n{t}\n" for m, t in zip(request.messages, texts, strict=True))
    if texts is None:
        return " ".join(str(p) for p in request.prompt)
    return texts[0]
