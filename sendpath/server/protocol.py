"""The replica's reading of a request: the shared schema, then what this engine supports.

The body is read by ``api.json_body`` (size, depth and finite-number limits) and checked
against ``api.schema`` (the same models the gateway checks and both publish); then the
options this engine does not implement are refused by name, and the rest becomes a
``SamplingParams``. Every mistake is an ``InvalidRequestError`` (400, OpenAI's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sendpath.api.json_body import load_json
from sendpath.api.schema import ChatBody, CompletionBody, content_text, validate
from sendpath.errors import InvalidRequestError
from sendpath.request import SamplingParams

__all__ = ["ParsedRequest", "parse_chat", "parse_completion"]


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


def _params(
    body: ChatBody | CompletionBody, max_tokens: int | None, default_max: int
) -> SamplingParams:
    if body.n != 1:
        raise InvalidRequestError("Only n=1 is supported.", param="n")
    if body.presence_penalty or body.frequency_penalty:
        name = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise InvalidRequestError(f"{name} is not supported; leave it at 0.", param=name)
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported.", param="logprobs")
    if isinstance(body, ChatBody) and body.top_logprobs:
        raise InvalidRequestError("top_logprobs are not supported.", param="top_logprobs")
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
    body: ChatBody = validate(ChatBody, load_json(raw))
    messages = [{"role": m.role, "content": content_text(m.content)} for m in body.messages]
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
    body: CompletionBody = validate(CompletionBody, load_json(raw))
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
