"""DecodeLane: parked decodes advanced by a step counter, their blocks and finishes."""

from __future__ import annotations

from array import array

from sendpath.engine.scheduler import RunnerOutput, Scheduler
from sendpath.engine.steps import StepShape
from sendpath.sim.decode_lane import AnswerIds, DecodeLane, beside, decode_seconds
from tests.factories import make_request, make_scheduler


def prefilled(s: Scheduler) -> None:
    """One step that computes every waiting prompt and samples its first token (7)."""
    plan = s.schedule()
    s.update(plan, RunnerOutput({item.request_id: 7 for item in plan.requests}))


def test_parked_decodes_get_blocks_when_they_cross_and_finish_at_their_step() -> None:
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", 6, max_tokens=6))  # 2 blocks, 2 slots left
    s.add_request(make_request("b", 3, max_tokens=3))  # 1 block, 1 slot left
    prefilled(s)
    lane = DecodeLane(s.kv, AnswerIds(1000))  # a token's id: 1000 + its position
    lane.order(s.running)
    lane.park(s)
    assert not s.running and lane.batch == 2
    assert (lane.context(), lane.next_finish()) == (9, 2)
    # b crosses into a new block in step 2, a in step 3, and both every 4 steps after
    assert [lane.crossers(n) for n in (1, 2, 3, 5)] == [0, 1, 2, 2]
    lane.allocate(2)
    assert s.kv.block_ids("b") == [2, 3] and s.kv.block_ids("a") == [0, 1]
    lane.ran([1.0, 2.0])
    [(b, times)] = lane.finishing(s, continued=lambda _: False)
    assert b.request_id == "b" and times.tolist() == [1.0, 2.0] and s.running == [b]
    assert b.output_token_ids == [7, 1004, 1005] and b.num_computed_tokens == 5
    assert (lane.batch, lane.context()) == (1, 8)
    s.running.remove(b)
    # the rest back in the scheduler: a, written up to the 2 steps it ran parked
    assert lane.unpark(s) == {"a": array("d", [1.0, 2.0])} and lane.batch == 0
    [a] = s.running
    assert a.output_token_ids == [7, 1007, 1008] and a.num_computed_tokens == 8


def test_fitting_is_the_most_steps_whose_crossings_the_free_blocks_hold() -> None:
    s = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=256)
    for i, prompt in enumerate((1, 2, 3, 4, 5, 6, 7, 9, 13)):  # every phase, some twice
        s.add_request(make_request(f"r{i}", [i * 50 + t for t in range(prompt)], 100))
    prefilled(s)
    lane = DecodeLane(s.kv, AnswerIds(1000))
    lane.order(s.running)
    lane.park(s)
    for ran in range(4):  # each phase of the step counter
        for steps in range(0, 23):
            for free in range(0, 30):
                most = max(k for k in range(steps + 1) if lane.crossers(k) <= free)
                assert lane.fitting(steps, free) == most, (ran, steps, free)
        lane.allocate(1)
        lane.ran([float(ran)])


class Recorded:
    """A cost model that prices a step at its attended context, and keeps every shape."""

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []

    def step_seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return float(shape.context_tokens)


def test_decode_seconds_prices_each_step_of_the_batch() -> None:
    cost = Recorded()
    # 2 decodes with 9 tokens computed in all: each step computes 2 and attends to 2 more
    assert decode_seconds(cost, 2, 9, 3) == [11.0, 13.0, 15.0]
    assert cost.shapes[0] == StepShape(2, 2, 11, 11)
    assert cost.shapes[2] == StepShape(2, 2, 15, 15)


def test_parked_decodes_beside_a_step_add_a_token_each_and_their_context() -> None:
    chunk = StepShape(16, 1, 16 * 32 + 136, 48, 16, 1)  # a chunk of 16 resuming at 32
    assert beside(chunk, 3, 100) == StepShape(19, 4, 16 * 32 + 136 + 103, 48 + 103, 16, 1)


def test_answer_ids_are_base_plus_position_and_made_once() -> None:
    ids = AnswerIds(100)
    assert ids.take(0, 3) == [100, 101, 102] and ids.take(5, 0) == []
    late = ids.take(40, 2)
    assert late == [140, 141] and ids.take(40, 2)[0] is late[0]  # the same int object
