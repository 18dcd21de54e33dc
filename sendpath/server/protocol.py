"""The replica's reading of a request: JSON within limits, what this engine refuses, the schema.

``parse_chat`` / ``parse_completion`` take the raw body (its size capped by the app
before): ``api.json_body.load_json`` makes it a JSON object within depth, value-count and
finite-number limits; the options this engine does not implement are refused by name
(``UNSUPPORTED``); pydantic validates the rest against ``api.schema`` (the same models the
gateway checks and both publish in ``/openapi.json``); and what the schema cannot say
(``top_logprobs`` without ``logprobs``, an empty prompt, ``echo``, JSON output with
``ignore_eos``) is checked here before it becomes a ``SamplingParams``. Every mistake is
an ``InvalidRequestError`` (400, OpenAI's shape).

The schema ignores fields it does not know, as OpenAI does; but a field OpenAI or vLLM
define that would change the answer (beam search, audio, vLLM's guided_* fields, ...) must not be
dropped silently, so ``UNSUPPORTED`` names them and the values that ask for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sendpath.api.json_body import load_json
from sendpath.api.schema import ChatBody, CompletionBody, ResponseFormat, validate
from sendpath.errors import InvalidRequestError
from sendpath.model.tokenizer import Chat
from sendpath.request import SamplingParams, StructuredOutput
from sendpath.server.tools import ToolUse, chat_prompt, tool_use

__all__ = ["UNSUPPORTED", "ParsedRequest", "parse_chat", "parse_completion"]


def _absent(value: Any) -> bool:
    return value is None


def _one_of(*harmless: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == h for h in harmless)


# Fields that change the answer and this server does not do, each with a test for the
# values that ask for nothing (those pass).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": _one_of([]),  # OpenAI's old form of tools: send tools instead
    "function_call": _one_of("none", "auto"),
    "best_of": _one_of(1),
    "suffix": _one_of(""),
    "prediction": _absent,
    "audio": _absent,
    "modalities": _one_of(["text"]),
    "reasoning_effort": _absent,
    "web_search_options": _absent,
    "use_beam_search": _one_of(False),
    "length_penalty": _one_of(1, 1.0),
    "prompt_logprobs": _absent,
    "guided_json": _absent,
    "guided_regex": _absent,
    "guided_choice": _absent,
    "guided_grammar": _absent,
    "structured_outputs": _absent,
    "bad_words": _one_of([]),
    "allowed_token_ids": _absent,
    "logits_processors": _absent,
    "include_stop_str_in_output": _one_of(False),
    "skip_special_tokens": _one_of(True),
    "spaces_between_special_tokens": _one_of(True),
    "truncate_prompt_tokens": _absent,
    "chat_template": _absent,
    "chat_template_kwargs": _absent,
    "add_generation_prompt": _one_of(True),
    "continue_final_message": _one_of(False),
}


def _refuse_unsupported(data: dict[str, Any]) -> None:
    """400 naming the first field that asks for something this server does not do."""
    for name, harmless in UNSUPPORTED.items():
        if name in data and not harmless(data[name]):
            raise InvalidRequestError(
                f"{name} is not supported by this server; leave it out (or at its default).",
                param=name,
            )


@dataclass
class ParsedRequest:
    """What the engine needs, plus how to answer."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: str | list[int] | Chat
    params: SamplingParams
    max_tokens_given: bool  # False: max_tokens defaults to "until the context is full"
    n: int  # answers to give (each its own engine request: server/fanout.py)
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None
    tools: ToolUse | None = None  # how a chat answer may call tools (server/tools.py)


def _params(
    body: ChatBody | CompletionBody,
    max_tokens: int | None,
    default_max: int,
    logprobs: int | None,
    structured: StructuredOutput | None,
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    if structured is not None and body.ignore_eos:
        raise InvalidRequestError(
            "ignore_eos cannot go with a JSON answer (response_format, or tool_choice that "
            "forces a call): a complete one ends there.",
            param="ignore_eos",
        )
    return SamplingParams(
        max_tokens=default_max if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
        # without a max_tokens of its own the cap is the context's end: min_tokens fits under it
        min_tokens=body.min_tokens if max_tokens is not None else min(body.min_tokens, default_max),
        logprobs=logprobs,
        structured=structured,
    )


def _structured(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """OpenAI's response_format as the engine's constraint (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput({"type": "object"})
    spec = response_format.json_schema
    if spec is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs its json_schema: "
            '{"name": ..., "schema": {...}}.',
            param="response_format.json_schema",
        )
    return StructuredOutput(spec.json_schema if spec.json_schema is not None else {})


def parse_chat(raw: bytes, default_max: int) -> ParsedRequest:
    """Validate a /v1/chat/completions body."""
    data = load_json(raw)
    _refuse_unsupported(data)
    body: ChatBody = validate(ChatBody, data)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError(
            "top_logprobs needs logprobs: true; set both.", param="top_logprobs"
        )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    structured = _structured(body.response_format)
    tools, forced = tool_use(body, json_output=structured is not None)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return ParsedRequest(
        kind="chat",
        model=body.model,
        prompt=chat_prompt(body),
        params=_params(body, max_tokens, default_max, logprobs, structured or forced),
        max_tokens_given=max_tokens is not None,
        n=body.n,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        priority=body.priority,
        cache_salt=body.cache_salt,
        tools=tools,
    )


def parse_completion(raw: bytes, default_max: int) -> ParsedRequest:
    """Validate a /v1/completions body (prompt: text, token ids, or a one-item list of text)."""
    data = load_json(raw)
    _refuse_unsupported(data)
    body: CompletionBody = validate(CompletionBody, data)
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
        params=_params(
            body, body.max_tokens, default_max, body.logprobs, _structured(body.response_format)
        ),
        max_tokens_given=body.max_tokens is not None,
        n=body.n,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
