"""CpuStepShape: the step's shape plus the KV the CPU runner gathers for it."""

from __future__ import annotations

from sendpath.engine.scheduler import ScheduledRequest, SchedulerOutput
from sendpath.engine.steps import StepShape
from sendpath.runner.cpu_step import CpuStepShape, padded_decode_kv

PLAN = SchedulerOutput(
    [
        ScheduledRequest("a", [1] * 4, 0, [0], True),  # prefill of 4: gathers its 4
        ScheduledRequest("b", [1], 99, [1], True),  # decode at 99: 100 tokens, 7 blocks of 16
        ScheduledRequest("c", [1], 20, [2], True),  # decode at 20: padded to b's 7 blocks
    ]
)


def test_decodes_are_gathered_as_one_batch_padded_to_the_longest() -> None:
    shape = CpuStepShape.of(PLAN)
    assert shape == CpuStepShape(6, 3, 131, 125, 4, 1, 0, kv_gathered=4 + 2 * 112)
    assert StepShape.of(PLAN) == StepShape(6, 3, 131, 125, 4, 1, 0)  # the same shape
    assert CpuStepShape.of(PLAN, block_size=4).kv_gathered == 4 + 2 * 100
    assert padded_decode_kv(3, 17, 16) == 3 * 32 and padded_decode_kv(0, 0, 16) == 0


def test_decodes_beside_the_plan_count_as_if_they_were_in_it() -> None:
    # two decodes with 100 and 200 tokens computed, run beside the plan (the simulator's
    # parked ones), against the same two in the plan
    beside = CpuStepShape.of(PLAN, 16, more_decodes=(2, 300, 200))
    both = SchedulerOutput(
        [*PLAN.requests, ScheduledRequest("p", [1], 100, [3], True),
         ScheduledRequest("q", [1], 200, [4], True)]
    )  # fmt: skip
    assert beside == CpuStepShape.of(both)
    assert beside.kv_gathered == 4 + 4 * 208 and beside.num_seqs == 5
