"""A decode lane: a replica's decoding requests, parked out of its scheduler and advanced
by a step counter instead of one by one (the simulator's ``fleet`` mode).

A request whose prompt is computed only decodes from then on: every step computes one
token for it, and every ``block_size`` steps it needs one more KV block. Once parked
here (taken out of the scheduler's running list) it costs nothing per step:

- its progress is ``computed at parking + (steps run - steps run at parking)``;
- the steps' end times are logged once per replica, so its token times are a slice;
- it is in the bucket of the step phase (step number modulo ``block_size``) at which it
  crosses into a new block, so a step allocates blocks for that bucket only, in
  running order, as the scheduler's decodes would;
- it finishes at a known step (a heap), when its tokens, block hashes and token times
  are written into the real ``Request`` and the real scheduler frees it;
- one parked with its prompt's last token still to compute (a chunk boundary left one)
  gets its first token, the timeline events of it and its prompt's last block hashed
  when that step ends, as the scheduler's ``update`` would.

The scheduler keeps deciding everything else (admissions, prefill chunks, preemption):
the simulator hands it the replica's unparked requests with the parked decodes' share
of the budget and of the sequence cap taken out (``schedule(num_parked_decodes=n)``),
after allocating their blocks, which is the order the scheduler itself would go in
(decodes first, in running order). A step that might preempt is run with everyone
unparked. ``order`` keys keep the running order (admission order), which parking would
otherwise change when a request admitted later finishes its prefill first. Block ids
may come out in another order than in the detailed mode (they are labels); which blocks
are freed, cached and evicted when, and so every time, is the same, as the equality
test checks.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sendpath.engine.scheduler import Scheduler
from sendpath.engine.steps import StepShape
from sendpath.kvcache.manager import KVCacheManager
from sendpath.request import Request
from sendpath.sim.cost_model import CostModel
from sendpath.trace import EventType

__all__ = ["AnswerIds", "DecodeLane", "beside", "decode_seconds"]


class AnswerIds:
    """The simulated answers' token ids: ``base`` plus the token's position in its
    sequence, above every prompt id, the same in both modes. Answers need not differ
    from each other: a block's hash covers every block before it, and no two prompts
    begin alike. Each id's int is made once and shared (a million answers' tokens are
    then slices, not new ints)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self._table: list[int] = []

    def take(self, position: int, n: int) -> list[int]:
        """The ids of ``n`` tokens from ``position`` on."""
        end, have = position + n, len(self._table)
        if end > have:
            self._table += range(self.base + have, self.base + max(end, 2 * have))
        return self._table[position:end]


@dataclass(slots=True)
class _Parked:
    request: Request
    key: int  # running order
    step: int  # the lane's step count when parked
    computed: int  # its computed tokens then
    phase: int  # the step number modulo block_size at which it needs a new block


def decode_seconds(cost: CostModel, batch: int, context: int, steps: int) -> list[float]:
    """The seconds of ``steps`` decode steps of ``batch`` sequences whose computed tokens
    add up to ``context`` before the first; a cost model with ``decode_steps`` prices
    them in one call, bit for bit as ``step_seconds`` would."""
    fast = getattr(cost, "decode_steps", None)
    if fast is not None:
        seconds: list[float] = fast(batch, context, steps)
        return seconds
    seconds = []
    for _ in range(steps):
        context += batch
        seconds.append(cost.step_seconds(StepShape(batch, batch, context, context)))
    return seconds


def beside(shape: StepShape, decodes: int, computed: int) -> StepShape:
    """``shape`` with ``decodes`` parked decodes run beside it, their computed tokens
    ``computed`` summed: each computes one token and attends to its context and it."""
    added = computed + decodes
    return StepShape(
        shape.num_tokens + decodes,
        shape.num_seqs + decodes,
        shape.context_tokens + added,
        shape.kv_tokens + added,
        shape.prompt_tokens,
        shape.prefills,
    )


class DecodeLane:
    """One replica's parked decodes and its step counter."""

    def __init__(self, kv: KVCacheManager, ids: AnswerIds) -> None:
        self.kv, self.ids = kv, ids
        self.bs = kv.block_size
        self.step = 0  # steps the replica has run
        self._ends = array("d")  # end times of steps _offset + 1, _offset + 2, ...
        self._offset = 0
        self._parked: dict[str, _Parked] = {}
        self._finishes: list[tuple[int, int, str]] = []  # (last step, key, request id)
        self._buckets: list[list[tuple[int, str]]] = [[] for _ in range(self.bs)]  # key, id
        self._context = 0  # sum over parked of computed - step at parking
        self._keys: dict[str, int] = {}  # request id -> running order (unparked too)
        self._first: list[_Parked] = []  # parked before their first token (its step next)
        self._trim_at = 8192
        self._next_key = itertools.count()

    @property
    def batch(self) -> int:
        return len(self._parked)

    def context(self) -> int:
        """Computed tokens of the parked requests, summed, now."""
        return self._context + len(self._parked) * self.step

    def next_finish(self) -> int:
        """The step at whose end the next parked request finishes."""
        return self._finishes[0][0]

    def crossers(self, steps: int) -> int:
        """Blocks the parked requests need over the next ``steps`` steps."""
        rounds, rest = divmod(steps, self.bs)
        buckets, first = self._buckets, self.step + 1
        return rounds * len(self._parked) + sum(
            len(buckets[(first + i) % self.bs]) for i in range(rest)
        )

    def fitting(self, steps: int, free: int) -> int:
        """The most of the next ``steps`` steps whose new blocks ``free`` blocks hold
        (``crossers`` grows with the steps)."""
        batch, bs, buckets = len(self._parked), self.bs, self._buckets
        rounds = min(free // batch, steps // bs) if batch else steps // bs
        left = free - rounds * batch
        rest = bs - 1 if rounds < steps // bs else steps % bs  # steps in a last round
        first, extra = self.step + 1 + rounds * bs, 0
        while extra < rest:
            need = len(buckets[(first + extra) % bs])
            if need > left:
                break
            left -= need
            extra += 1
        return rounds * bs + extra

    def bulk(self, cost: CostModel, sched: Scheduler) -> list[float] | None:
        """The seconds of each step of only the parked decodes, up to the next finish,
        as far as the free blocks go, and before the scheduler could start anyone; None
        when not one step (then it plans the step, preempting where it must)."""
        steps = self.fitting(self.next_finish() - self.step, self.kv.pool.num_free_blocks)
        steps = self.steps_before_admission(sched, steps)
        if not steps:
            return None
        return decode_seconds(cost, self.batch, self.context(), steps)

    def steps_before_admission(self, sched: Scheduler, steps: int) -> int:
        """How many of the next ``steps`` steps of only the parked decodes run before
        the scheduler could start the head of its queue (all of them where it would not
        try: nobody waits, no slot is free). Until a request arrives or a parked one
        finishes, those steps only take blocks, in the pool's order, evicting cached
        ones: the free blocks shrink, and the head's prefix-cache hits with them (a hit
        block taken ends its chain), which the head's first chunk then computes. It
        starts at the first step after whose blocks its chunk's new blocks and its free
        hits are free (``allocate_slots``' test); between two of its hits' evictions
        each step only has fewer blocks free, so only the first step and the steps that
        shorten its chain are tried."""
        batch = len(self._parked)
        head = sched.next_to_admit(batch)
        if head is None or not steps:
            return steps
        kv, pool = self.kv, self.kv.pool
        hits = kv.get_computed_blocks(head)[0]
        free, free_hits = pool.num_free_blocks, pool.num_free_of(hits)
        need = sched.blocks_to_start(head, len(hits), batch)
        if need <= free - self.crossers(1) - free_hits:
            return 0  # most often: it starts in the next step
        if not free_hits:
            return steps  # no step can take one of its hits: each only has fewer free
        free_before = [0]  # free blocks among the first i hits
        for b in hits:
            free_before.append(free_before[-1] + (pool.ref_cnt(b) == 0))
        # where each free hit stands in the order the next steps take blocks
        index = {b: i for i, b in enumerate(hits)}
        taken_at = {
            index[b]: j
            for j, b in enumerate(pool.free_block_ids(self.crossers(steps)))
            if b in index
        }
        # (step, hits left) each time a taken hit shortens the chain, in step order
        shorter: list[tuple[int, int]] = []
        first_taken = steps + 1
        for i in sorted(taken_at):
            step = self.fitting(steps, taken_at[i]) + 1  # the first step to take it
            if step < first_taken:
                shorter.append((step, i))
                first_taken = step
        for step, left in shorter[::-1]:
            need = sched.blocks_to_start(head, left, batch)
            if need <= free - self.crossers(step) - free_before[left]:
                return step - 1
        return steps

    def can_schedule_beside(self, sched: Scheduler) -> bool:
        """Whether the scheduler can plan the rest of the next step beside the parked
        decodes (``schedule(num_parked_decodes=batch)``): not when that step might
        preempt, or when the budget runs out within the decodes; then everyone goes back
        to it."""
        batch, bs = len(self._parked), self.bs
        budget = sched.config.max_num_batched_tokens - batch
        if budget <= 0:
            return False
        need = self.crossers(1)
        block_ids = self.kv.block_ids
        for r in sched.running:  # at most their whole chunks: more than they can take
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            blocks = -(-(r.num_computed_tokens + min(left, budget)) // bs)
            need += max(0, blocks - len(block_ids(r.request_id)))
        return need <= self.kv.pool.num_free_blocks

    # ------------------------------------------------------------ running order

    def order(self, running: Iterable[Request]) -> None:
        """Give newly admitted requests (at the end of the running list) their keys."""
        keys = self._keys
        for r in running:
            if r.request_id not in keys:
                keys[r.request_id] = next(self._next_key)

    def forget(self, request_id: str) -> None:
        """A request left the running list (preempted: it re-enters at the end)."""
        self._keys.pop(request_id, None)

    # ------------------------------------------------------------ in and out

    def park(self, sched: Scheduler) -> None:
        """Take every decoding request out of the scheduler's running list."""
        keep = []
        for r in sched.running:
            computed = r.num_computed_tokens
            if len(r.prompt_token_ids) + len(r.output_token_ids) - computed != 1:
                keep.append(r)
                continue
            rid, step, key = r.request_id, self.step, self._keys[r.request_id]
            slack = len(self.kv.block_ids(rid)) * self.bs - computed
            assert 0 <= slack < self.bs, "a decode holds the blocks for its tokens, no more"
            phase = (step + slack + 1) % self.bs
            self._parked[rid] = _Parked(r, key, step, computed, phase)
            left = r.sampling_params.max_tokens - len(r.output_token_ids)
            heapq.heappush(self._finishes, (step + left, key, rid))
            bisect.insort(self._buckets[phase], (key, rid))
            self._context += computed - step
            if not r.output_token_ids:
                self._first.append(self._parked[rid])
        sched.running[:] = keep

    def _write(self, p: _Parked, sched: Scheduler, cache: bool = True) -> array[float]:
        """Bring a parked request's ``Request`` up to now (``cache``: offer its filled
        blocks to the prefix cache); its token times since parking."""
        r, k = p.request, self.step - p.step
        r.num_computed_tokens = p.computed + k
        r.output_token_ids += self.ids.take(len(r.prompt_token_ids) + len(r.output_token_ids), k)
        sched.num_computed_tokens += k
        if cache:
            self.kv.cache_computed_blocks(r)
        lo = p.step - self._offset
        return self._ends[lo : lo + k]

    def _drop(self, p: _Parked) -> None:
        del self._parked[p.request.request_id]
        self._context -= p.computed - p.step
        bucket = self._buckets[p.phase]
        del bucket[bisect.bisect_left(bucket, p.key, key=lambda e: e[0])]

    def finishing(
        self, sched: Scheduler, continued: Callable[[str], bool]
    ) -> list[tuple[Request, array[float]]]:
        """The parked requests whose last token came with the step just run, written up
        and back in the running list (in running order) for the scheduler to finish.
        An answer no later request continues (``continued``) is not hashed into the
        prefix cache: its token ids are its own, so nobody could ever hit it, and which
        blocks are freed and evicted when is the same."""
        out = []
        heap = self._finishes
        while heap and heap[0][0] == self.step:
            _, _, rid = heapq.heappop(heap)
            p = self._parked[rid]
            out.append((p.request, self._write(p, sched, continued(rid))))
            self._drop(p)
            self._keys.pop(rid)
            sched.running.append(p.request)
        self._trim()
        return out

    def unpark(self, sched: Scheduler) -> dict[str, array[float]]:
        """Everyone back in the running list, in running order; their token times."""
        times = {}
        for rid, p in self._parked.items():
            times[rid] = self._write(p, sched)
        keys = self._keys
        sched.running[:] = sorted(
            [p.request for p in self._parked.values()] + sched.running,
            key=lambda r: keys[r.request_id],
        )
        self._parked.clear()
        self._first.clear()  # their step did not run: the scheduler runs it
        self._finishes.clear()
        for bucket in self._buckets:
            bucket.clear()
        self._context = 0
        self._trim()
        return times

    # ------------------------------------------------------------ steps

    def allocate(self, steps: int) -> None:
        """Blocks for the parked requests that cross into a new one in the next ``steps``
        steps, step by step, in running order (enough free blocks checked before)."""
        buckets, bs, first = self._buckets, self.bs, self.step + 1
        crossing = [rid for s in range(first, first + steps) for _, rid in buckets[s % bs]]
        if crossing:
            self.kv.append_blocks(crossing)

    def ran(self, ends: list[float]) -> None:
        """Steps ended at ``ends`` (blocks allocated for them before)."""
        self.step += len(ends)
        self._ends.extend(ends)
        for p in self._first:  # their prompt's last token was computed in the first step
            r, at = p.request, ends[0]
            r.record(EventType.PREFILL_CHUNK, at, 1)
            r.record(EventType.FIRST_TOKEN, at)
            r.num_computed_tokens = p.computed + 1
            self.kv.cache_computed_blocks(r)  # a prompt block it filled: findable now
        self._first.clear()

    def _trim(self) -> None:
        """Drop logged end times no parked request needs."""
        if not self._parked:
            self._offset, self._ends = self.step, array("d")
        elif len(self._ends) > self._trim_at:
            low = min(p.step for p in self._parked.values())
            del self._ends[: low - self._offset]
            self._offset = low
            self._trim_at = max(8192, 2 * len(self._ends))
