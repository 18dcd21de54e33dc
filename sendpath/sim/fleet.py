"""The fleet mode's one question: may a replica run its next decode steps in bulk, and
what do they cost?

A replica may when nothing else can happen on it before its next finish: every running
request past its prefill, nobody waiting who could start, and KV blocks for every step
(else steps, and preemptions, go one by one through the scheduler). The steps up to
that finish are then priced at once: each a decode of the whole batch, one token
further on; a cost model with ``decode_steps`` prices them in one call, bit for bit as
its ``step_seconds`` would.
"""

from __future__ import annotations

from sendpath.engine.scheduler import Scheduler
from sendpath.engine.steps import StepShape
from sendpath.sim.cost_model import CostModel

__all__ = ["decode_run"]


def decode_run(sched: Scheduler, cost: CostModel) -> list[float] | None:
    """The seconds of each decode step up to the next finish (at least two), or None when
    the scheduler has a decision to make first."""
    kv, running = sched.kv, sched.running
    batch = len(running)
    if not batch or batch > sched.config.max_num_batched_tokens:
        return None
    if len(sched.waiting) and batch < sched.config.max_num_seqs:
        return None  # someone could start: the scheduler decides
    steps = 1 << 62
    context = longest = 0
    for r in running:
        computed = r.num_computed_tokens
        if len(r.prompt_token_ids) + len(r.output_token_ids) - computed != 1:
            return None  # still prefilling
        left = r.sampling_params.max_tokens - len(r.output_token_ids)
        if left < steps:
            steps = left
        context += computed
        if computed > longest:
            longest = computed
    if steps < 2:
        return None
    bs, free = kv.block_size, kv.pool.num_free_blocks
    if batch * (steps // bs + 1) > free:  # else there is room whatever the block fill
        needed = sum(
            max(0, -(-(r.num_computed_tokens + steps) // bs) - len(kv.block_ids(r.request_id)))
            for r in running
        )
        if needed > free:
            return None  # the cache fills up first: steps, and preemptions, one by one
    fast = getattr(cost, "decode_steps", None)
    if fast is not None:
        seconds: list[float] = fast(batch, context, steps)
        return seconds
    seconds = []
    for _ in range(steps):
        context += batch
        longest += 1  # the batch the CPU runner gathers, padded to the longest
        gathered = batch * -(-longest // bs) * bs
        seconds.append(cost.step_seconds(StepShape(batch, batch, context, context,
                                                   kv_gathered=gathered)))  # fmt: skip
    return seconds
