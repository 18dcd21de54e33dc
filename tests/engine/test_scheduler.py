"""Scheduler: what runs each step, chunked prefill, preemption, policies, aborts, bounds."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sendpath.engine.scheduler import Scheduler, SchedulerOutput
from sendpath.errors import QueueFullError
from sendpath.request import Request, RequestStatus
from sendpath.runner.fake_runner import FakeRunner
from sendpath.trace import EventType
from tests.factories import make_request, make_scheduler


def plan_of(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in out.requests]


def step(s: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    plan = s.schedule()
    s.update(plan, runner.execute(plan))
    return plan


def finish_if_done(s: Scheduler) -> None:
    for r in list(s.running):
        if len(r.output_token_ids) >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED)


def test_decodes_planned_elsewhere_take_their_budget_and_slots_first() -> None:
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=3, block_size=4)
    for name in ("a", "b", "c"):
        s.add_request(make_request(name, 10))
    # two decodes run beside this plan (parked by the simulator) leave 6 tokens and one
    # sequence slot
    plan = s.schedule(num_parked_decodes=2)
    assert plan_of(plan) == [("a", 0, 6, False)] and len(s.waiting) == 2


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    s = make_scheduler(max_num_batched_tokens=8, block_size=4)
    runner = FakeRunner()
    s.add_request(make_request("short", 3, max_tokens=10))
    assert plan_of(step(s, runner)) == [("short", 0, 3, True)]
    s.add_request(make_request("long", 20))
    # the decode of "short" first, then 7 tokens of the long prompt
    assert plan_of(step(s, runner)) == [("short", 3, 1, True), ("long", 0, 7, False)]
    assert plan_of(step(s, runner)) == [("short", 4, 1, True), ("long", 7, 7, False)]
    assert plan_of(step(s, runner)) == [("short", 5, 1, True), ("long", 14, 6, True)]
    assert plan_of(step(s, runner)) == [("short", 6, 1, True), ("long", 20, 1, True)]
    long = s.requests["long"]
    chunks = [e.num_tokens for e in long.timeline.events if e.type is EventType.PREFILL_CHUNK]
    assert chunks == [7, 7, 6]
    # blocks are taken as each request grows: "short" got 0, then 3 for its 5th token
    assert s.kv.block_ids("short") == [0, 3]
    assert s.kv.block_ids("long") == [1, 2, 4, 5, 6, 7]


def test_long_prefill_threshold_leaves_budget_for_a_short_prompt() -> None:
    s = make_scheduler(max_num_batched_tokens=8, block_size=4, long_prefill_token_threshold=4)
    runner = FakeRunner()
    s.add_request(make_request("long", 20))
    assert plan_of(step(s, runner)) == [("long", 0, 4, False)]  # capped at 4, not 8
    s.add_request(make_request("short", 3))
    # the short prompt starts beside the long one's next chunk instead of after all of it
    assert plan_of(step(s, runner)) == [("long", 4, 4, False), ("short", 0, 3, True)]
    assert plan_of(step(s, runner)) == [("short", 3, 1, True), ("long", 8, 4, False)]


def test_max_num_seqs_and_budget_limit_admission() -> None:
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4))
    plan = s.schedule()
    assert plan_of(plan) == [("r0", 0, 4, True), ("r1", 0, 4, True)]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 1


def test_preemption_takes_the_newest_and_it_recomputes_later() -> None:
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each hold 2 blocks
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    runner = FakeRunner()
    s.add_request(make_request("old", 7, max_tokens=6, arrival=0.0))
    s.add_request(make_request("new", 7, max_tokens=6, arrival=1.0))
    step(s, runner)  # both prefilled: 7 computed + 1 sampled each, 2 blocks each
    assert s.kv.pool.num_free_blocks == 0
    assert plan_of(step(s, runner)) == [("old", 7, 1, True), ("new", 7, 1, True)]
    plan = step(s, runner)  # "old" needs a 3rd block for position 8 -> "new" is preempted
    assert plan.preempted == ["new"]
    assert plan_of(plan) == [("old", 8, 1, True)]
    new = s.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["new"]
    assert [e.type for e in new.timeline.events][-1] is EventType.PREEMPTED
    while s.has_unfinished_requests():
        step(s, runner)
        finish_if_done(s)
    assert s.kv.pool.num_free_blocks == 4
    # recomputed from the cached prefix where possible, and the output is what it would be alone
    alone = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    alone.add_request(make_request("new", 7, max_tokens=6))
    while alone.has_unfinished_requests():
        step(alone, runner)
        if len(alone.requests["new"].output_token_ids) == 6:
            ref = alone.requests["new"].output_token_ids
            alone.finish_request("new", RequestStatus.FINISHED)
    assert new.output_token_ids == ref


def test_a_request_preempts_itself_when_it_is_the_newest() -> None:
    s = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=32)
    runner = FakeRunner()
    s.add_request(make_request("a", 4, arrival=0.0))
    s.add_request(make_request("b", 3, arrival=1.0))
    step(s, runner)  # a: 4 prompt -> block 0 full; b: block 1
    plan = s.schedule()  # a needs a new block for token 5 -> preempt b; b then gone
    assert plan.preempted == ["b"] and plan_of(plan) == [("a", 4, 1, True)]


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("low", 4, priority=5, arrival=0.0))
    s.add_request(make_request("high", 4, priority=0, arrival=1.0))
    s.add_request(make_request("mid", 4, priority=2, arrival=2.0))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "low"]
    assert plan_of(s.schedule()) == [("high", 0, 4, True)]


def test_priority_victim_is_lowest_priority_not_newest() -> None:
    s = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=32, policy="priority")
    runner = FakeRunner()
    s.add_request(make_request("vip", 4, priority=0, arrival=2.0))
    s.add_request(make_request("bulk", 4, priority=9, arrival=1.0))
    step(s, runner)  # vip block 0, bulk block 1, one block free
    # both need a new block for position 4; vip goes first and takes the free one; bulk is
    # then out of blocks and, as the lowest priority, preempts itself although vip is newer
    plan = s.schedule()
    assert plan.preempted == ["bulk"]
    assert plan_of(plan) == [("vip", 4, 1, True)]


def test_abort_while_waiting_running_and_between_schedule_and_update() -> None:
    s = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    s.add_request(make_request("run", 5))
    s.add_request(make_request("wait", 5))
    plan = s.schedule()
    s.finish_request("wait", RequestStatus.ABORTED)
    assert len(s.waiting) == 0
    s.finish_request("run", RequestStatus.ABORTED)  # after schedule, before update
    assert s.update(plan, runner.execute(plan)) == []
    assert s.kv.pool.num_free_blocks == 64 and not s.has_unfinished_requests()
    assert s.finish_request("run", RequestStatus.ABORTED) is None  # idempotent


def test_queue_bound_raises_a_specific_error() -> None:
    s = make_scheduler(max_queued_requests=2)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    with pytest.raises(QueueFullError) as info:
        s.add_request(make_request("c", 4))
    assert info.value.status_code == 503 and "2 requests waiting" in info.value.message
    s.schedule()  # a and b leave the queue
    s.add_request(make_request("c", 4))


def test_prefix_cache_hit_is_counted_and_skips_computation() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner()
    prompt = list(range(200, 218))  # 18 tokens: 4 full blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    step(s, runner)
    s.finish_request("a", RequestStatus.FINISHED)
    s.add_request(make_request("b", [*prompt, 5], max_tokens=1))
    assert plan_of(s.schedule()) == [("b", 16, 3, True)]
    assert s.requests["b"].num_cached_tokens == 16
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (18 + 19, 16)


Plan = tuple[list[tuple[str, int, int, list[int]]], list[str]]


def _plans(seed: int, one_by_one: bool) -> tuple[list[Plan], int]:
    """Every step's plan (ids, positions, tokens, block tables, preempted) for a random
    workload on a cache small enough to preempt; ``one_by_one``: decodes never at once."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=12, max_num_seqs=6)
    took = 0
    grow = s.kv.grow_decodes

    def counted(requests: Sequence[Request]) -> bool:
        nonlocal took
        fits = False if one_by_one else grow(requests)
        took += fits and bool(requests)
        return fits

    s.kv.grow_decodes = counted  # type: ignore[method-assign]
    runner, plans = FakeRunner(), list[Plan]()
    for i in range(60):
        if rng.random() < 0.5:
            s.add_request(make_request(f"r{i}", rng.randint(1, 14), max_tokens=rng.randint(1, 16)))
        plan = step(s, runner)
        plans.append(
            (
                [
                    (r.request_id, r.start_pos, r.num_tokens, list(r.block_ids))
                    for r in plan.requests
                ],
                list(plan.preempted),
            )
        )
        finish_if_done(s)
    return plans, took


@pytest.mark.parametrize("seed", range(6))
def test_decodes_planned_at_once_plan_what_one_by_one_would(seed: int) -> None:
    at_once, took = _plans(seed, one_by_one=False)
    assert at_once == _plans(seed, one_by_one=True)[0]
    assert took > 0  # the workload ran the all-at-once path, and preempted too
    assert any(preempted for _, preempted in at_once)
