"""Requests and their sampling parameters: plain data shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from sendpath.errors import InvalidSamplingParamsError
from sendpath.trace import EventType, Timeline

__all__ = ["GREEDY_BELOW", "Request", "RequestStatus", "SamplingParams"]

GREEDY_BELOW = 1e-5  # temperatures under this sample as temperature 0


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop, as in vLLM and the OpenAI API.

    ``temperature == 0`` is greedy, and so is any temperature below ``GREEDY_BELOW`` (as
    vLLM does: dividing logits by 1e-300 would overflow them to NaN). ``top_k <= 0`` (or
    ``None``) disables top-k. ``seed`` makes a sampled request reproducible on its own,
    whatever runs beside it. Stop strings are not included in the returned text; stop token
    ids are not either, unless they are EOS.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

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
