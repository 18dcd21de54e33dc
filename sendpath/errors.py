"""Errors a user can hit, each with a message that says what to do.

Every error carries an OpenAI-style ``type``/``code``/``param`` so the HTTP layers can
turn it into ``{"error": {...}}`` without a second table of messages.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ContentFilterError",
    "InternalServerError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "MissingExtraError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "QueueFullError",
    "QuotaExceededError",
    "RateLimitError",
    "RequestFailedError",
    "RequestTimeoutError",
    "RequestTooLargeError",
    "SendpathError",
    "ServiceUnavailableError",
    "TraceNotFoundError",
    "UnsupportedModelError",
]


class SendpathError(Exception):
    """Base class of every error sendpath raises on purpose."""

    type: str = "internal_error"
    code: str | None = None
    status_code: int = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(SendpathError):
    """The model file or directory is missing, unreadable or malformed."""

    type = "model_load_error"
    code = "model_not_loadable"


class UnsupportedModelError(ModelLoadError):
    """The model exists but its architecture, quantization or tokenizer is not supported."""

    code = "unsupported_model"


class InvalidRequestError(SendpathError):
    """A request that can never succeed as sent (HTTP 400)."""

    type = "invalid_request_error"
    status_code = 400


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is outside its allowed range."""

    code = "invalid_sampling_params"


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"The prompt is {prompt_tokens} tokens long, but this model's context window is "
            f"{max_model_len} tokens and at least one token must be left to generate. "
            "Shorten the prompt or the conversation.",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class QueueFullError(SendpathError):
    """The engine's waiting queue is at ``max_queued_requests``: try again shortly (HTTP 503)."""

    type = "overloaded_error"
    code = "queue_full"
    status_code = 503

    def __init__(self, max_queued: int) -> None:
        super().__init__(
            f"The server's queue is full ({max_queued} requests waiting). Retry in a moment."
        )
        self.max_queued = max_queued


class ModelNotFoundError(SendpathError):
    """The request names a model this server does not serve (HTTP 404)."""

    type = "invalid_request_error"
    code = "model_not_found"
    status_code = 404

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"The model {model!r} does not exist on this server; it serves {served!r} "
            "(GET /v1/models lists it).",
            param="model",
        )


class RequestTooLargeError(SendpathError):
    """The request body is over the server's size limit (HTTP 413)."""

    type = "invalid_request_error"
    code = "request_too_large"
    status_code = 413

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"The request body is {size} bytes, over this server's limit of {limit} bytes. "
            "Send a shorter prompt."
        )


class ServiceUnavailableError(SendpathError):
    """The server cannot take requests right now (loading, draining): retry (HTTP 503)."""

    type = "overloaded_error"
    code = "service_unavailable"
    status_code = 503


class AuthenticationError(SendpathError):
    """No API key, a malformed one, an unknown one or a revoked one (HTTP 401)."""

    type = "invalid_request_error"
    code = "invalid_api_key"
    status_code = 401


class RateLimitError(SendpathError):
    """Over a per-minute limit (HTTP 429); ``type`` says which: "requests" or "tokens"."""

    code = "rate_limit_exceeded"
    status_code = 429

    def __init__(self, message: str, kind: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.type = kind
        self.headers = headers or {}  # Retry-After and the x-ratelimit-* headers


class QuotaExceededError(SendpathError):
    """The key's daily token quota is used up (HTTP 429, OpenAI's ``insufficient_quota``)."""

    type = "insufficient_quota"
    code = "insufficient_quota"
    status_code = 429


class ContentFilterError(InvalidRequestError):
    """The input breaks a safety category (HTTP 400, code ``content_filter``)."""

    code = "content_filter"

    def __init__(self, category: str, param: str = "messages") -> None:
        super().__init__(
            f"The request was blocked by the safety filter (category: {category}). "
            "Rephrase the message; the operator sets the rules with --safety-rules.",
            param=param,
        )
        self.category = category


class TraceNotFoundError(SendpathError):
    """No trace with this id here (HTTP 404): unknown, someone else's, or too old."""

    type = "invalid_request_error"
    code = "trace_not_found"
    status_code = 404

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"No trace {request_id!r} here: the id is the response's `id` (or its "
            "x-request-id header), only the key that made the request can read it, and only "
            "the most recent requests are kept.",
            param="request_id",
        )


class InternalServerError(SendpathError):
    """Something failed on our side (HTTP 500). The client sees the request id, never the
    exception's text: that goes to the server's log."""

    type = "server_error"
    code = "internal_error"
    status_code = 500

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"The server had an error while processing request {request_id}. Retry it; if "
            "the error persists, give the operator this id."
        )


class RequestFailedError(SendpathError):
    """The engine could not compute this request (HTTP 500) and stopped it; everyone else's
    requests went on. Sending the same request again fails the same way, so the gateway
    does not retry it elsewhere."""

    type = "server_error"
    code = "request_failed"
    status_code = 500

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"The engine could not compute request {request_id} (its numbers could not be "
            "sampled, or a step failed on it) and stopped it; other requests were not "
            "affected. The same request will fail again: check its parameters, or give the "
            "operator this id."
        )


class RequestTimeoutError(SendpathError):
    """The client took too long to send its request (HTTP 408)."""

    type = "invalid_request_error"
    code = "request_timeout"
    status_code = 408


class MissingExtraError(SendpathError):
    """A feature's optional dependency is not installed; the message names the extra."""

    type = "missing_extra"
    code = "missing_extra"
