"""Engine steps as the engine ran them: each step's shape and how long it took.

``StepShape`` is what a step's cost depends on whatever runs it (tokens computed,
sequences, the context they attend to, the KV they read); the simulator's cost models
price it, and the engine core records every real step's shape with its wall time in a
``StepLog`` (a bounded ring, read by the replica's ``GET /v1/steps``), so a live server
can be calibrated as it serves (`sendpath profile --url`).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from sendpath.engine.scheduler import SchedulerOutput

__all__ = ["StepLog", "StepRecord", "StepShape"]


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on: tokens computed, and the context each one reads."""

    num_tokens: int
    num_seqs: int
    context_tokens: int  # sum over computed tokens of the positions they attend to
    kv_tokens: int  # sum over sequences of the KV they read once (their whole context)
    # the prompt's share: tokens of the prefill chunks (every sequence not decoding one
    # token), and how many chunks; 0 where unknown (steps logged before they were kept)
    prompt_tokens: int = 0
    prefills: int = 0
    # speculative decoding: draft tokens verified beside their sequences' decode tokens
    # (rows of the matmuls as a prompt's are, in sequences that count as decodes)
    draft_tokens: int = 0

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepShape:
        """The shape of the step that runs ``plan``."""
        tokens = context = kv = prompt = prefills = drafts = 0
        for item in plan.requests:
            n, start = len(item.token_ids), item.start_pos
            tokens += n
            context += n * start + n * (n + 1) // 2
            kv += start + n
            if item.num_drafts:  # a decode and its drafts
                drafts += item.num_drafts
            elif not (n == 1 and start > 0):  # a prefill chunk, not a decode
                prompt += n
                prefills += 1
        return cls(tokens, len(plan.requests), context, kv, prompt, prefills, drafts)


@dataclass(frozen=True)
class StepRecord:
    seq: int  # 1, 2, 3, ... since the engine started
    start: float  # clock seconds
    seconds: float  # schedule + forward + update
    busy_after: bool  # requests were left: the next step followed at once
    shape: StepShape


class StepLog:
    """The last ``capacity`` steps (written by the engine thread only)."""

    def __init__(self, capacity: int = 8192) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=capacity)
        self._seq = itertools.count(1)

    def record(self, start: float, seconds: float, busy_after: bool, shape: StepShape) -> None:
        self._steps.append(StepRecord(next(self._seq), start, seconds, busy_after, shape))

    @property
    def last(self) -> StepRecord | None:
        return self._steps[-1] if self._steps else None

    def since(self, seq: int) -> list[StepRecord]:
        """Steps after ``seq`` (0: all kept), oldest first."""
        return [s for s in self._steps if s.seq > seq]
