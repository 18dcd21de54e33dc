"""The OpenTelemetry GenAI semantic conventions' names, as sendpath fills them.

Span names are ``{gen_ai.operation.name} {gen_ai.request.model}``; the request's
attributes come from the OpenAI body as the client sent it. Nothing here records a prompt
or an answer's text, nor a key: only its name (``sendpath.key.name``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sendpath.telemetry.spans import AttributeValue

__all__ = ["OPERATIONS", "PROVIDER", "operation_of", "request_attributes", "span_name"]

PROVIDER = "sendpath"  # gen_ai.provider.name: the server that runs the model
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

# body field -> attribute (numbers)
_NUMBERS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
}


MAX_MODEL = 256  # characters of a client's model name kept in a span
# stop sequences kept only within the API's own bounds (api/schema.py: 16 of 1,024)
MAX_STOP, MAX_STOP_CHARS = 16, 1024


def operation_of(path: str) -> str | None:
    """The GenAI operation a request path is (``None``: not a generation request)."""
    return OPERATIONS.get(path)


def span_name(operation: str, model: str | None) -> str:
    return f"{operation} {model[:MAX_MODEL]}" if model else operation


def request_attributes(operation: str, body: Mapping[str, Any] | None) -> dict[str, AttributeValue]:
    """``gen_ai.operation.name``, ``gen_ai.provider.name`` and the ``gen_ai.request.*`` a
    body sets (``None``: not read yet, e.g. refused at the key check)."""
    out: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
    }
    if body is None:
        return out
    model = body.get("model")
    if isinstance(model, str):
        out["gen_ai.request.model"] = model[:MAX_MODEL]
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(cap, int) and not isinstance(cap, bool):
        out["gen_ai.request.max_tokens"] = cap
    for name, attribute in _NUMBERS.items():
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[attribute] = value
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n != 1:
        out["gen_ai.request.choice.count"] = n
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if (
        isinstance(stops, list)
        and 0 < len(stops) <= MAX_STOP
        and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)
    ):  # what the API takes; a body past it is refused, and its span waits in the queue
        out["gen_ai.request.stop_sequences"] = stops
    return out


def usage_attributes(
    usage: tuple[int, int] | None, cached: int | None
) -> dict[str, AttributeValue]:
    """``gen_ai.usage.*`` from (prompt, completion) tokens and the prompt's cached ones."""
    out: dict[str, AttributeValue] = {}
    if usage is not None:
        out["gen_ai.usage.input_tokens"], out["gen_ai.usage.output_tokens"] = usage
    if cached is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = cached
    return out
