"""StepShape: a step's tokens, sequences, attended context and KV, from its plan."""

from __future__ import annotations

from sendpath.engine.scheduler import ScheduledRequest, SchedulerOutput
from sendpath.engine.steps import StepLog, StepShape


def test_step_shape_counts_tokens_context_kv_and_prompt_chunks() -> None:
    plan = SchedulerOutput(
        [
            ScheduledRequest("a", [1] * 4, 0, [0], True),  # prefill of 4: attends 1+2+3+4
            ScheduledRequest("b", [1], 99, [1], True),  # decode at position 99: attends 100
            ScheduledRequest("c", [1], 20, [2], True),  # decode at 20: attends 21
            ScheduledRequest("d", [1] * 3, 8, [3], False),  # a later chunk: attends 9+10+11
            ScheduledRequest("e", [1], 0, [4], True),  # a one-token prompt: a chunk, no decode
        ]
    )
    assert StepShape.of(plan) == StepShape(
        num_tokens=10, num_seqs=5, context_tokens=162, kv_tokens=137, prompt_tokens=8, prefills=3
    )
    assert StepShape.of(SchedulerOutput()) == StepShape(0, 0, 0, 0)


def test_a_decode_with_drafts_is_a_decode_whose_drafts_are_counted_apart() -> None:
    """Speculative decoding: the decode token at 50 and three drafts after it attend
    51+52+53+54; no prompt chunk; the simulator's fit prices each draft's row as a
    prompt token's (``sim/calibrated.py``)."""
    from sendpath.sim.calibrated import _features

    plan = SchedulerOutput([ScheduledRequest("a", [5, 6, 7, 8], 50, [0, 1, 2, 3], True, 3)])
    shape = StepShape.of(plan)
    assert shape == StepShape(4, 1, 210, 54, prompt_tokens=0, prefills=0, draft_tokens=3)
    assert _features(shape) == (1.0, 3, 210, 54, 1)


def test_step_log_keeps_the_last_steps_numbered_from_one() -> None:
    log = StepLog(capacity=2)
    assert log.last is None
    for i in range(3):
        log.record(float(i), 0.5, True, StepShape(i + 1, 1, 1, 1))
    assert [r.seq for r in log.since(0)] == [2, 3] and [r.seq for r in log.since(2)] == [3]
    last = log.last
    assert last is not None and last.start == 2.0 and last.shape.num_tokens == 3
