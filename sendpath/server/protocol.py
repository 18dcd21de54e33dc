"""The OpenAI request bodies this server accepts, validated into engine inputs.

Parsing is done by hand from the raw body so every client mistake gets OpenAI's error
shape with the right status: bad UTF-8 or JSON, wrong types, missing or empty fields,
values out of range, unsupported options. Unknown extra fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sendpath.errors import InvalidRequestError
from sendpath.request import SamplingParams

__all__ = ["ParsedRequest", "load_json", "parse_chat", "parse_completion"]

ROLES = ("system", "developer", "user", "assistant", "tool")
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's field: tenant prefix cache


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False


@dataclass
class ParsedRequest:
    """What the engine needs, plus how to answer."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    params: SamplingParams
    max_tokens_given: bool  # False: max_tokens defaults to "until the context is full"
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid UTF-8 (bad byte at position {exc.start})."
        ) from exc
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno})."
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body


def _validate(model: type[_Common], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        # drop pydantic's union-member tags ("str", "list[TextPart]") from the field path
        param = ".".join(
            str(p) for p in err["loc"] if str(p) not in _TYPE_TAGS and "[" not in str(p)
        )
        if err["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        elif err["type"] == "too_short":
            message = f"'{param}' must not be empty."
        else:
            message = f"Invalid value for '{param}': {err['msg']}."
        raise InvalidRequestError(message, param=param or None) from exc


def _params(body: _Common, max_tokens: int | None, default_max: int) -> SamplingParams:
    if body.n != 1:
        raise InvalidRequestError("Only n=1 is supported.", param="n")
    if body.presence_penalty or body.frequency_penalty:
        name = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise InvalidRequestError(f"{name} is not supported; leave it at 0.", param=name)
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported.", param="logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=default_max if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )


def parse_chat(raw: bytes, default_max: int) -> ParsedRequest:
    """Validate a /v1/chat/completions body."""
    body: ChatBody = _validate(ChatBody, load_json(raw))
    messages = []
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role is {m.role!r}; use one of {', '.join(ROLES)}.",
                param=f"messages.{i}.role",
            )
        content = (
            m.content
            if isinstance(m.content, str) or m.content is None
            else "".join(p.text for p in m.content)
        )
        messages.append({"role": m.role, "content": content or ""})
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return ParsedRequest(
        kind="chat",
        model=body.model,
        prompt=messages,
        params=_params(body, max_tokens, default_max),
        max_tokens_given=max_tokens is not None,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        priority=body.priority,
        cache_salt=body.cache_salt,
    )


def parse_completion(raw: bytes, default_max: int) -> ParsedRequest:
    """Validate a /v1/completions body (prompt: text, token ids, or a one-item list of text)."""
    body: CompletionBody = _validate(CompletionBody, load_json(raw))
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise InvalidRequestError("Send one prompt per request.", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequestError("'prompt' must not be empty.", param="prompt")
    if body.echo:
        raise InvalidRequestError("echo is not supported.", param="echo")
    return ParsedRequest(
        kind="completion",
        model=body.model,
        prompt=prompt,  # type: ignore[arg-type]
        params=_params(body, body.max_tokens, default_max),
        max_tokens_given=body.max_tokens is not None,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
