"""The scheduler: which requests compute how many tokens in the next step.

One rule: each request's ``num_computed_tokens`` catches up with ``num_tokens``. Every step
fills a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. running requests, decodes first, then ongoing prefills (their next chunk);
   when the KV cache is out of blocks, the policy's last request (newest, or lowest
   priority) is preempted: its blocks are freed and it goes back to the waiting queue,
   to be recomputed from the start (from its cached prefix, if still cached);
2. then, if nobody was preempted, waiting requests in policy order, each starting from
   its longest cached prefix, while budget, sequence slots and blocks last.

A prompt longer than the budget left is split over several steps (chunked prefill), so
one long prompt never stalls the running decodes; with ``long_prefill_token_threshold``
one prompt's chunk is capped too, so short prompts arriving meanwhile start at once.
With speculative decoding (``speculative``) a decode that carries draft tokens
(``Request.spec_token_ids``, ``engine/speculative.py``) is planned as one chunk of its
decode token and its drafts, within the budget left (drafts that do not fit are dropped);
``update`` counts only the drafts the runner kept as computed and gives back the blocks
that only the others' slots were in. Torch-free; time comes from a ``Clock``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sendpath.clock import Clock
from sendpath.config import SchedulerConfig
from sendpath.errors import QueueFullError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.request import Request, RequestStatus, TokenLogprobs
from sendpath.trace import Event, EventType

if TYPE_CHECKING:
    from sendpath.engine.speculative import SpecStats

from .queue import make_queue

__all__ = ["RunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput", "SchedulerStats"]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions from ``start_pos``."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the KV manager's live table: read it before the next schedule
    sample: bool  # True when this step reaches the last known token: sample the next one
    num_drafts: int = 0  # the last ones of ``token_ids`` are draft tokens to verify

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """The plan of one step: what the runner needs (block tables are live: read them now)."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class RunnerOutput:
    """What a step produced: one sampled token per request whose plan had ``sample``,
    except those in ``failed`` (request id -> why, for the log): their step could not be
    computed or sampled, and they end with an error while the rest go on."""

    sampled: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # a request whose plan had drafts: those it kept, which come before its sampled token
    accepted: dict[str, list[int]] = field(default_factory=dict)

    def merge(self, other: RunnerOutput) -> None:
        """Take ``other``'s results too (another part of the same step's requests)."""
        self.sampled.update(other.sampled)
        self.failed.update(other.failed)
        self.logprobs.update(other.logprobs)
        self.accepted.update(other.accepted)

    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # where asked for


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_computed_tokens: int  # all tokens run through the model so far (prefill + decode)
    spec: SpecStats | None = None  # speculative decoding's totals, where it is on


class Scheduler:
    """Waiting and running queues over one KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock: Clock) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self.speculative = False  # decodes may carry draft tokens (the engine sets it)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request, queued_at: float | None = None) -> None:
        """Queue a request; ``QueueFullError`` when ``max_queued_requests`` are waiting.
        ``queued_at``: when it joined the queue, if before now (handed over mid-step)."""
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(limit)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        request.record(EventType.QUEUED, self.clock.now() if queued_at is None else queued_at)
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request wherever it is (waiting, running); frees its blocks. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        event = EventType.FINISHED if status is RequestStatus.FINISHED else EventType.ABORTED
        request.record(event, self.clock.now())
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self, num_parked_decodes: int = 0) -> SchedulerOutput:
        """Plan the next step (mutates queues, block tables and request status).

        ``num_parked_decodes``: decoding requests that run in this step although they are
        not in ``running``. Only the simulator's fleet mode passes it: it takes requests
        that only decode out of the running list and advances them itself, all at once
        (``sim/decode_lane.py``), having allocated their blocks already. Each still takes
        a token of the budget and a sequence slot, before anyone here, as it would in the
        running list (decodes are planned first). The engine always passes 0."""
        now = self.clock.now()
        budget = self.config.max_num_batched_tokens - num_parked_decodes
        max_seqs = self.config.max_num_seqs - num_parked_decodes
        planned: dict[str, tuple[Request, int]] = {}  # id -> tokens this step, in plan order
        preempted: list[str] = []

        # 1. running: decodes first, then prefill chunks (each group in running order)
        decodes: list[Request] = []  # these lists are snapshots: preemption removes
        prefills: list[tuple[Request, int]] = []  # (request, tokens left to compute)
        for request in self.running:
            left = (
                len(request.prompt_token_ids)
                + len(request.output_token_ids)
                - request.num_computed_tokens
            )
            if left > 1:
                prefills.append((request, left))
            else:
                decodes.append(request)
        drafting: list[Request] = []
        if self.speculative and any(r.spec_token_ids for r in decodes):
            drafting = [r for r in decodes if r.spec_token_ids]
            decodes = [r for r in decodes if not r.spec_token_ids]
        if len(decodes) <= budget and self.kv.grow_decodes(decodes):  # all fit: at once
            for request in decodes:
                planned[request.request_id] = (request, 1)
            budget -= len(decodes)
        else:  # one by one, preempting until each fits
            for request in decodes:
                if budget and not (preempted and request.request_id in preempted):
                    budget = self._plan(request, 1, budget, planned, preempted, now)
        for request in drafting:  # a decode and as many of its drafts as the budget holds
            if budget and not (preempted and request.request_id in preempted):
                n = min(1 + len(request.spec_token_ids), budget)
                if n > 1 and self.kv.allocate_slots(request, n) is None:
                    n = 1  # no blocks for the drafts: never preempt anyone for them
                budget = self._plan(request, n, budget, planned, preempted, now)
        for request, left in prefills:
            if budget and not (preempted and request.request_id in preempted):
                n = self._chunk(left, budget)
                budget = self._plan(request, n, budget, planned, preempted, now)

        # 2. waiting, unless this step had to preempt
        while not preempted and len(self.waiting) and budget > 0 and len(self.running) < max_seqs:
            request = self.waiting.peek()
            hits, num_hit = self.kv.get_computed_blocks(request)
            n = self._chunk(request.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(request, n, hits) is None:
                break
            self.waiting.pop()
            self.kv.count_lookup(request.num_tokens, num_hit)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.record(EventType.SCHEDULED, now)
            self.running.append(request)
            planned[request.request_id] = (request, n)
            budget -= n

        out = SchedulerOutput(preempted=preempted)
        items, block_ids = out.requests, self.kv.block_ids
        for request_id, (request, n) in planned.items():
            start = request.num_computed_tokens
            end = start + n
            known = len(request.prompt_token_ids) + len(request.output_token_ids)
            drafts = 0
            if n == 1 and end == known:  # a decode: the last known token
                ids = request.output_token_ids[-1:] or request.prompt_token_ids[-1:]
            elif end > known:  # a decode and its drafts
                drafts = end - known
                ids = request.token_ids(start, known) + request.spec_token_ids[:drafts]
            else:
                ids = request.token_ids(start, end)
            table = block_ids(request_id)  # the KV manager's live list
            items.append(ScheduledRequest(request_id, ids, start, table, end >= known, drafts))
        return out

    def _plan(
        self,
        request: Request,
        n: int,
        budget: int,
        planned: dict[str, tuple[Request, int]],
        preempted: list[str],
        now: float,
    ) -> int:
        """Room for ``n`` tokens of a running request, preempting the policy's last
        requests until it fits (or it was the last); returns the budget left."""
        allocate = self.kv.allocate_slots
        while allocate(request, n) is None:
            victim = self._pick_victim(exclude=preempted)
            self._preempt(victim, now)
            preempted.append(victim.request_id)
            budget += planned.pop(victim.request_id, (victim, 0))[1]
            if victim is request:
                return budget
        planned[request.request_id] = (request, n)
        return budget - n

    def next_to_admit(self, num_parked_decodes: int = 0) -> Request | None:
        """The request ``schedule(num_parked_decodes)`` would try to start first, if it
        would try anyone: someone waits, and a sequence slot and a token of the budget
        are left. Only the simulator's fleet mode asks (``sim/decode_lane.py``)."""
        budget = self.config.max_num_batched_tokens - num_parked_decodes
        max_seqs = self.config.max_num_seqs - num_parked_decodes
        if not len(self.waiting) or budget <= 0 or len(self.running) >= max_seqs:
            return None
        return self.waiting.peek()

    def blocks_to_start(
        self, request: Request, num_hit_blocks: int, num_parked_decodes: int = 0
    ) -> int:
        """The new blocks a waiting request's first chunk takes after ``num_hit_blocks``
        prefix-cache hits: ``schedule`` starts it when this many blocks are free beside
        the hits that are free themselves."""
        budget = self.config.max_num_batched_tokens - num_parked_decodes
        n = self._chunk(request.num_tokens - num_hit_blocks * self.kv.block_size, budget)
        return self.kv.blocks_needed(request, n, num_hit_blocks)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute this step: what is left, within the budget and the cap on
        one prefill chunk (a decode's single token is never capped)."""
        cap = self.config.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap is not None else min(remaining, budget)

    def update(
        self, plan: SchedulerOutput, result: RunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Apply a finished step: advance progress, cache full blocks, append sampled tokens.

        Returns (request, new tokens) pairs: one token, or a verified decode's kept drafts
        and the token after them; requests aborted since ``schedule`` are skipped. The
        caller decides whether a token finishes its request (``finish_request``), and
        drops the tokens after the one that does.
        """
        now = self.clock.now()
        new_tokens: list[tuple[Request, list[int]]] = []
        requests, cache_blocks, running, bs = (
            self.requests,
            self.kv.cache_computed_blocks,
            RequestStatus.RUNNING,
            self.kv.block_size,
        )
        token_event = Event(EventType.TOKEN, now)  # the same for every token of this step
        computed = 0
        for item in plan.requests:
            request = requests.get(item.request_id)
            if request is None or request.status is not running:
                continue
            if item.num_drafts:
                computed += self._verified(request, item, result, token_event, new_tokens)
                continue
            n = len(item.token_ids)
            request.num_computed_tokens += n
            computed += n
            if n > 1 or request.num_computed_tokens % bs == 0:  # else no block filled up
                cache_blocks(request)
            output = request.output_token_ids
            if not output:
                request.record(EventType.PREFILL_CHUNK, now, n)
            if item.sample:
                token = result.sampled[item.request_id]
                if not output:
                    request.record(EventType.FIRST_TOKEN, now)
                output.append(token)
                request.timeline.events.append(token_event)
                new_tokens.append((request, [token]))
        self.num_computed_tokens += computed
        return new_tokens

    def _verified(
        self,
        request: Request,
        item: ScheduledRequest,
        result: RunnerOutput,
        token_event: Event,
        new_tokens: list[tuple[Request, list[int]]],
    ) -> int:
        """Apply a decode that verified drafts: its decode token and the kept drafts are
        computed, the rejected drafts' slots are not (their blocks go back); returns the
        tokens computed."""
        tokens = [*result.accepted.get(item.request_id, ()), result.sampled[item.request_id]]
        request.num_computed_tokens += len(tokens)  # the decode token and the kept drafts
        request.spec_token_ids = []
        request.output_token_ids += tokens
        request.timeline.events += [token_event] * len(tokens)
        self.kv.trim(request)
        self.kv.cache_computed_blocks(request)
        new_tokens.append((request, tokens))
        return len(tokens)

    # ------------------------------------------------------------------ preemption

    def _pick_victim(self, exclude: list[str]) -> Request:
        candidates = [
            (self.waiting.victim_key(r), i, r)
            for i, r in enumerate(self.running)
            if r.request_id not in exclude
        ]
        return max(candidates, key=lambda c: (c[0], c[1]))[2]

    def _preempt(self, request: Request, now: float) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.record(EventType.PREEMPTED, now)
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.num_queries,
            prefix_cache_hits=self.kv.num_hits,
            num_preemptions=self.num_preemptions,
            num_computed_tokens=self.num_computed_tokens,
        )
