"""The OpenAI request bodies, one schema per endpoint, shared by the gateway and the replica.

Both check a body against the same model at their edge, so a request the gateway lets
through never surprises the replica, and both publish these schemas as their OpenAPI
request bodies (what a client generator or a fuzzer reads). The schemas say what is
well-formed: types (strict: ``"1"`` is not a number, ``true`` is not an int; a whole
number written ``5.0`` is the integer 5, as JSON Schema counts it), finite numbers in the
ranges OpenAI and vLLM document, token ids that fit an int32, bounded lists. What a
particular server supports (``n > 1``, penalties, logprobs) is that server's own check.
Unknown fields are ignored, as OpenAI ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from sendpath.errors import InvalidRequestError

__all__ = [
    "DEFAULT_CAP_HEADER",
    "ROLES",
    "ChatBody",
    "CompletionBody",
    "DetokenizeBody",
    "Message",
    "NamedTool",
    "TextPart",
    "TokenizeBody",
    "Tool",
    "ToolCall",
    "content_text",
    "validate",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
# A gateway that filled in max_tokens for a request without one says so in this header
# ("default"): a replica then stops such a request at the context's end instead of
# refusing it as too long, as it would a client's own max_tokens.
DEFAULT_CAP_HEADER = "x-sendpath-max-tokens"
INT32 = 2**31
MAX_STOP = 16  # stop strings (OpenAI: 4); each is checked against every new token
MAX_STOP_IDS = 1024
MAX_PROMPT_IDS = 2**20  # a token-id prompt (a million tokens: past any context here)
MAX_MESSAGES = 10_000
MAX_PARTS = 10_000  # content parts of one message
MAX_LOGIT_BIAS = 1024  # entries (OpenAI documents no limit; each costs a little per token)
MAX_TOOLS = 128  # OpenAI's limit on tools (and here on one message's tool calls)
MAX_DESCRIPTION = 4096  # characters of a function's description
MAX_ARGUMENTS = 1 << 20  # characters of one tool call's arguments in a message
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


def _whole(value: Any) -> Any:
    """JSON has one number type: ``5.0`` is a valid "integer" to JSON Schema, so take it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**64:
        return int(value)
    return value


_WHOLE = BeforeValidator(_whole)  # after the constraints, so the schema shows them
TokenId = Annotated[int, Field(ge=0, lt=INT32), _WHOLE]
TokenCount = Annotated[int, Field(ge=1, lt=INT32), _WHOLE]
TopK = Annotated[int, Field(ge=-1, lt=INT32), _WHOLE]  # vLLM's: 0 or -1 turn it off
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), _WHOLE]
Choices = Annotated[int, Field(ge=1, le=128), _WHOLE]
Priority = Annotated[int, Field(ge=-INT32, lt=INT32), _WHOLE]  # vLLM's: lower runs first
LogprobCount = Annotated[int, Field(ge=0, le=20), _WHOLE]
MinTokens = Annotated[int, Field(ge=0, lt=INT32), _WHOLE]
# OpenAI's logit_bias: token ids as JSON object keys (strings of digits), -100..100 each
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=MAX_LOGIT_BIAS),
]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP)]
# Lists a client sizes: bounded, and checked item by item only up to the first bad one
# (fail_fast: a million bad ids make one error, not a million).
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS, fail_fast=True)]
StopIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_IDS, fail_fast=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]


class FunctionCall(_Strict):
    """A call an assistant made: the function's name and its arguments as JSON text."""

    name: FunctionName
    arguments: str = Field(max_length=MAX_ARGUMENTS)


class ToolCall(_Strict):
    """One of an assistant message's ``tool_calls``."""

    id: str = Field(min_length=1, max_length=64)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS, fail_fast=True)] | None = (
        None
    )
    name: str | None = Field(None, max_length=64)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: str | None = Field(None, min_length=1, max_length=64)  # tool: what it answers


class FunctionDef(_Strict):
    """A function the model may call: OpenAI's ``tools[].function``."""

    name: FunctionName
    description: str | None = Field(None, max_length=MAX_DESCRIPTION)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedTool(_Strict):
    """``tool_choice`` naming the one function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = Field(max_length=256)
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: StopString | StopList | None = None
    stop_token_ids: StopIds | None = None
    ignore_eos: bool = False
    n: Choices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's (> 0; 1 is off), bounded so that no logit it divides overflows
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's
    min_tokens: MinTokens = 0  # vLLM's
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)
    priority: Priority = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM's


class ChatBody(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True


class CompletionBody(_Common):
    """``POST /v1/completions``: a text prompt, token ids, or a one-item list of text (one
    prompt per request)."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: LogprobCount | None = None


class TokenizeBody(_Strict):
    """``POST /tokenize`` (vLLM's): a prompt or a chat's messages to token ids, the count
    the engine would compute (the chat template included for messages)."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: (
        Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
        | None
    ) = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool = True


class DetokenizeBody(_Strict):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model: str | None = Field(None, max_length=256)
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS, fail_fast=True)]


def content_text(content: str | list[TextPart] | None) -> str:
    """A message's text as the model sees it: its parts joined with nothing between."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text for p in content)


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``model`` checked from ``body``; ``InvalidRequestError`` naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # of a union's failed members, the one whose type matched and that went deepest
        # says most ([5, -1] as token ids: "item 1 must be >= 0", not "not a string")
        err = max(exc.errors(), key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))
        # keep field names and list indices; drop pydantic's union-member tags ("str",
        # "list[TextPart]", "constrained-str", "function-before[...]")
        param = ".".join(
            str(p)
            for p in err["loc"]
            if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)
        )
        if err["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        elif err["type"] == "too_short" and not err.get("ctx", {}).get("min_length", 1) > 1:
            message = f"'{param}' must not be empty."
        else:
            given = err.get("input")
            shown = repr(given) if isinstance(given, int | float | str) else None
            if shown is not None and len(shown) <= 40:
                message = f"Invalid value for '{param}': {err['msg']} (got {shown})."
            else:
                message = f"Invalid value for '{param}': {err['msg']}."
        raise InvalidRequestError(message, param=param or None) from exc
