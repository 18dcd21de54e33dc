"""Requests and their sampling parameters: plain data shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sendpath.errors import InvalidSamplingParamsError
from sendpath.trace import EventType, Timeline

__all__ = [
    "GREEDY_BELOW",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutput",
    "TokenLogprobs",
]

GREEDY_BELOW = 1e-5  # temperatures under this sample as temperature 0


@dataclass(frozen=True)
class StructuredOutput:
    """What the answer must be: JSON matching ``json_schema`` (OpenAI's ``response_format``;
    ``json_object`` is the schema ``{"type": "object"}``). ``model/structured.py`` enforces
    it token by token; or a tool call's, from ``tools``). ``source`` names the request field
    the schema came from, for errors."""

    json_schema: dict[str, Any]
    source: str = "response_format"


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop, as in vLLM and the OpenAI API.

    ``temperature == 0`` is greedy, and so is any temperature below ``GREEDY_BELOW`` (as
    vLLM does: dividing logits by 1e-300 would overflow them to NaN). ``top_k <= 0`` (or
    ``None``) disables top-k. ``seed`` makes a sampled request reproducible on its own,
    whatever runs beside it. Stop strings are not included in the returned text; stop token
    ids are not either, unless they are EOS.

    The logit adjustments (``model/sampler.py`` says in which order): ``presence_penalty`` /
    ``frequency_penalty`` (OpenAI's, -2..2, over the output), ``repetition_penalty``
    (vLLM's, 0.01..100, 1 is off, over prompt and output), ``logit_bias`` (token id -> -100..100),
    ``min_tokens`` (no EOS or stop token id before this many), ``min_p`` (0..1).
    ``logprobs``: return the chosen token's log-probability and this many alternatives'.
    ``structured``: constrain the answer to JSON matching a schema.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits change before the choice (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def validate(self) -> None:
        """Raise ``InvalidSamplingParamsError`` naming the first bad field."""
        checks: list[tuple[bool, str, str, object]] = [  # messages formatted on failure only
            (
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                "max_tokens must be an integer >= 1, got {!r}.",
                self.max_tokens,
            ),
            (
                _is_number(self.temperature) and 0.0 <= self.temperature < float("inf"),
                "temperature",
                "temperature must be a finite number >= 0 (0 means greedy), got {!r}.",
                self.temperature,
            ),
            (
                _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
                "top_p",
                "top_p must be in (0, 1], got {!r}.",
                self.top_p,
            ),
            (
                self.top_k is None or (_is_int(self.top_k) and self.top_k >= -1),
                "top_k",
                "top_k must be an integer >= 1, or 0 / -1 to disable it, got {!r}.",
                self.top_k,
            ),
            (
                self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
                "seed",
                "seed must be an integer in [-2**63, 2**64), got {!r}.",
                self.seed,
            ),
            (
                _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
                "min_p",
                "min_p must be in [0, 1], got {!r}.",
                self.min_p,
            ),
            (
                _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                "presence_penalty must be in [-2, 2], got {!r}.",
                self.presence_penalty,
            ),
            (
                _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2], got {!r}.",
                self.frequency_penalty,
            ),
            (
                _is_number(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
                "repetition_penalty",
                "repetition_penalty must be in [0.01, 100] (1 turns it off), got {!r}.",
                self.repetition_penalty,
            ),
            (
                all(
                    _is_int(t) and t >= 0 and _is_number(b) and -100.0 <= b <= 100.0
                    for t, b in self.logit_bias.items()
                ),
                "logit_bias",
                "logit_bias must map token ids (integers >= 0) to numbers in [-100, 100].",
                None,
            ),
            (
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must be an integer from 0 to max_tokens ({!r}).",
                self.max_tokens,
            ),
            (
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                "logprobs",
                "logprobs must be an integer from 0 to 20, got {!r}.",
                self.logprobs,
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "stop must be a list of non-empty strings.",
                None,
            ),
            (
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be a list of token ids (integers >= 0).",
                None,
            ),
        ]
        for ok, param, message, value in checks:
            if not ok:
                message = message.format(value)
                raise InvalidSamplingParamsError(message, param=param)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model, and the ``k`` likeliest
    tokens' (id, log-probability), likeliest first (``SamplingParams.logprobs``)."""

    logprob: float
    top: list[tuple[int, float]]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


class RequestStatus(StrEnum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV blocks gone: recomputed when rescheduled
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # the engine could not compute it (a step failed on it); stopped


@dataclass(slots=True)
class Request:
    """A request as the scheduler and KV manager see it: token ids and progress, no text.

    The one rule of scheduling: ``num_computed_tokens`` catches up with ``num_tokens``.
    Prefill, chunked prefill and decode are all "how many tokens this step".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None  # tenants with different salts never share cached blocks
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    # speculative decoding: drafts for its next step (``engine/speculative.py``), and how
    # many it proposed and kept so far
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens ``start:end`` (prompt then output), without joining the two lists."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - n]

    @property
    def is_prefilling(self) -> bool:
        """True while known tokens remain uncomputed beyond the one a decode step feeds."""
        return self.num_tokens - self.num_computed_tokens > 1

    def record(self, type: EventType, time: float, num_tokens: int = 0) -> None:
        self.timeline.record(type, time, num_tokens)
