"""``--speculative-config``: vLLM's keys for speculative decoding, parsed and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["SpeculativeConfig"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's ``--speculative-config`` keys: each decode step a
    request may propose up to ``num_speculative_tokens`` next tokens, verified in the same
    forward pass (``engine/speculative.py``). ``method`` ``ngram``: prompt lookup, the
    tokens that followed the longest earlier match (``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens) of the sequence's last tokens. ``draft_model`` (the
    method wherever ``model`` is given): a small model sharing the tokenizer proposes
    them (``engine/draft.py``); ``draft_layers`` (ours) keeps only its first layers, so
    the target's own file, truncated, is a self-draft. ``disable_by_batch_size``: no
    proposals in a step with more decoding requests than this (there the batch already
    keeps the machine busy and verifying costs more than it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 4
    model: str | None = None  # the draft model's path (method draft_model)
    draft_layers: int | None = None  # its first layers only (None: all)

    KEYS = (
        "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "model", "draft_layers",
    )  # fmt: skip
    METHODS = ("ngram", "draft_model")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not available: use one of "
                f"{', '.join(self.METHODS)}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'speculative method "draft_model" takes the draft\'s path in "model", and '
                '"model" goes with that method only'
            )
        if self.draft_layers is not None and (self.model is None or self.draft_layers < 1):
            raise ValueError("draft_layers must be >= 1, and goes with a draft model only")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be 1 to 16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 16, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def parse(cls, text: str | dict[str, object]) -> SpeculativeConfig:
        """From ``--speculative-config``'s JSON (or its dict); ``ValueError`` naming what
        is wrong: bad JSON, an unknown key, a value of the wrong type or range."""
        if isinstance(text, str):
            try:
                given = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not JSON: {exc}") from None
        else:
            given = text
        if not isinstance(given, dict):
            raise ValueError(
                "speculative config must be a JSON object, e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        unknown = sorted(set(given) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"speculative config has unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(cls.KEYS)}"
            )
        for key, value in given.items():
            if key in ("method", "model"):
                if not isinstance(value, str) or not value:
                    raise ValueError(f"speculative config: {key} must be a string, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative config: {key} must be an integer, got {value!r}")
        if "model" in given and "method" not in given:
            given = {**given, "method": "draft_model"}  # as vLLM infers it
        return cls(**given)
