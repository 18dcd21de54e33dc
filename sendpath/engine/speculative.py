"""Speculative decoding: propose a request's next tokens cheaply, verify them in one step.

After each step the ``Speculator`` gives every decoding request that can use it up to
``num_speculative_tokens`` draft tokens (``Request.spec_token_ids``). The scheduler plans
them with the request's decode token, as one chunk of ``1 + k`` tokens in the step's
budget; the runner computes all of those rows in the one batched forward pass, samples
each row as it would sample a plain decode, and keeps the drafts up to the first one the
model did not produce, plus the token it produced there (``accept``). For greedy requests
the text is token for token what it is without speculation; for sampled ones this is the
rejection-sampling rule for a draft that is one token for sure (an n-gram's), so the
distribution is unchanged: the draft is kept with the model's own probability of it, and
where it is not, the token drawn is one of the others in proportion to theirs. The
rejected drafts' KV slots are simply not counted as computed; blocks they alone filled
are given back (``KVCacheManager.trim``).

Proposals come from prompt lookup (``NgramIndex``): the tokens that followed the latest
earlier occurrence of the sequence's last ``n`` tokens, the longest ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min`` that occurs. Quoting answers (a
summary of a pasted text, an edit, a RAG answer) repeat long runs of their prompt, and
there most drafts are kept.

Speculation is off where it costs more than it saves:

- a step with more decoding requests than ``disable_by_batch_size``: the batch already
  reads the weights for many rows, and each draft is one more row of compute;
- a request whose drafts keep being refused: after a proposal that kept none, it waits
  twice as many steps as the last time before it proposes again (up to ``MAX_BACKOFF``);
  one that kept some proposes at once again;
- a request whose sampling reads its own history row by row (penalties, a grammar,
  ``min_tokens`` not yet reached) or asks for logprobs: those run without drafts;
- a sampled request with a ``seed``: each verified row takes a draw from its generator,
  and whether a step drafts depends on what else runs, so its tokens would depend on
  its batch; seeded, it decodes without drafts and gives the same tokens whatever
  shares its batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Protocol

from sendpath.request import Request, SamplingParams
from sendpath.speculative_config import SpeculativeConfig

__all__ = [
    "MAX_BACKOFF",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "SpecStats",
    "Speculator",
    "accept",
    "can_speculate",
]

logger = logging.getLogger("sendpath.engine")

MAX_BACKOFF = 64  # steps a request waits at most, after refused drafts, to propose again


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens can be verified as a batch of rows: its sampling
    does not change with each token it adds (no penalties, no grammar, no held-back end
    tokens), it does not ask for logprobs, and it is greedy or not seeded."""
    return (
        (params.greedy or params.seed is None)
        and params.structured is None
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
    )


def accept(drafts: list[int], sampled: list[int]) -> tuple[list[int], int]:
    """The drafts kept and the token after them: ``sampled`` holds the model's token for
    each row (``len(drafts) + 1``: after the last known token, then after each draft).
    A draft is kept while it is what the model produced at its place; the model's token
    at the first place it differs (or after the last draft) comes next."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == sampled[kept]:
        kept += 1
    return drafts[:kept], sampled[kept]


class NgramIndex:
    """One request's n-grams (``n`` from ``low`` to ``high``) -> where the latest earlier
    occurrence ended, kept up to date a token at a time as the request grows."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``ends``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram that ends ``tokens`` and
        occurred before (its latest occurrence); ``[]`` if none did."""
        last = len(tokens) - 1  # n-grams ending here are the query, not yet indexed
        ends, low, high = self.ends, self.low, self.high
        for end in range(self.indexed, last):
            for n in range(low, min(high, end + 1) + 1):
                ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(high, len(tokens)), low - 1, -1):
            at = ends.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at + 1 : at + 1 + k]
        return []


class Proposer(Protocol):
    """Where drafts come from: prompt lookup (``NgramProposer``), a draft model
    (``engine/draft.py``)."""

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """For each (request, k): up to ``k`` tokens the request might say next, by id
        (all at once: a draft model runs them as one batch)."""
        ...

    def remove(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup over each request's own tokens (an ``NgramIndex`` each)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = {}
        for request, k in wanted:
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.low, self.high)
            out[request.request_id] = index.propose(request.all_token_ids, k)
        return out

    def remove(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@dataclass
class SpecStats:
    """Totals since the engine started, in vLLM's ``spec_decode_*`` terms."""

    num_drafts: int = 0  # proposals verified (one per request per step that had drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # kept at draft position i

    def snapshot(self) -> SpecStats:
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))

    def count(self, num_drafts: int, num_kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for i in range(num_kept):
            self.accepted_per_pos[i] += 1


@dataclass
class _Track:
    wait: int = 0  # steps left before it proposes again
    backoff: int = 1  # the next wait, after a proposal that kept nothing


class Speculator:
    """Drafts for the engine's decoding requests, and what became of them."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(
            config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.stats = SpecStats()
        self._tracks: dict[str, _Track] = {}

    def propose(self, running: list[Request]) -> None:
        """Set each running request's ``spec_token_ids`` for the next step (``[]``: none)."""
        decoding = [r for r in running if not r.is_prefilling]
        for request in decoding:
            request.spec_token_ids = []
        if len(decoding) > self.config.disable_by_batch_size:
            return
        k = self.config.num_speculative_tokens
        wanted: list[tuple[Request, int]] = []
        for request in decoding:
            params = request.sampling_params
            # room: what max_tokens and the context still allow after the next token
            room = (
                min(
                    params.max_tokens - len(request.output_token_ids),
                    self.max_model_len - request.num_tokens,
                )
                - 1
            )
            if room < 1 or not can_speculate(params, len(request.output_token_ids)):
                continue
            track = self._tracks.get(request.request_id)
            if track is None:
                track = self._tracks[request.request_id] = _Track()
            if track.wait:
                track.wait -= 1
                continue
            wanted.append((request, min(k, room)))
        if not wanted:
            return
        try:
            drafts = self.proposer.propose(wanted)
        except Exception:  # a draft is never worth a request: decode without, start over
            logger.exception("the drafts could not be proposed; these requests go without")
            for request, _ in wanted:
                self.proposer.remove(request.request_id)
            return
        for request, _ in wanted:
            request.spec_token_ids = drafts.get(request.request_id, [])

    def verified(self, request: Request, num_drafts: int, num_kept: int) -> None:
        """A step verified ``num_drafts`` of the request's drafts and kept ``num_kept``."""
        self.stats.count(num_drafts, num_kept)
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_kept
        track = self._tracks.get(request.request_id)
        if track is None:
            return
        if num_kept:
            track.backoff = 1
        else:
            track.wait = track.backoff
            track.backoff = min(2 * track.backoff, MAX_BACKOFF)

    def remove(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        self.proposer.remove(request_id)
