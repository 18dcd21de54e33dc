"""One request cannot stop the engine: a step that fails on one request fails that request
alone (finish reason ``error``), the others get the tokens they would have got anyway, and
only a device that cannot compute at all stops the engine."""

from __future__ import annotations

import pytest
import torch

from sendpath.engine.core import EngineCore
from sendpath.engine.isolation import EngineFaultError
from sendpath.engine.outputs import FinishReason
from sendpath.model.loader import LoadedModel
from sendpath.request import RequestStatus, SamplingParams
from tests.engine.test_core import make_core
from tests.factories import POISON, FaultyRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def faulty(core: EngineCore) -> FaultyRunner:
    """Put a ``FaultyRunner`` around the core's runner."""
    runner = FaultyRunner(core.runner)
    core.runner = runner
    return runner


def drain(core: EngineCore) -> dict[str, FinishReason | None]:
    reasons: dict[str, FinishReason | None] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return reasons


def test_a_failing_request_fails_alone_and_the_others_get_their_tokens(
    tiny: LoadedModel,
) -> None:
    clean = make_core(tiny)
    expected = [clean.add_request([5, 6, 7, i], GREEDY) for i in range(3)]
    drain(clean)

    core = make_core(tiny)
    faulty(core)
    good = [core.add_request([5, 6, 7, i], GREEDY) for i in range(3)]
    bad = core.add_request([9, POISON, 9], GREEDY)  # fails at its prefill, in a shared step
    reasons = drain(core)
    assert reasons[bad.request_id] is FinishReason.ERROR
    assert bad.status is RequestStatus.FAILED and bad.output_token_ids == []
    for mine, theirs in zip(good, expected, strict=True):
        assert reasons[mine.request_id] is FinishReason.LENGTH
        assert mine.output_token_ids == theirs.output_token_ids  # as if it had run alone
    kv = core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # nothing leaked
    # and the engine keeps serving
    after = core.add_request([5, 6, 7, 0], GREEDY)
    drain(core)
    assert after.output_token_ids == expected[0].output_token_ids


def test_the_others_keep_their_logprobs_when_a_step_is_run_again_one_by_one(
    tiny: LoadedModel,
) -> None:
    core = make_core(tiny)
    faulty(core)
    asked = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    good = core.add_request([5, 6, 7], asked)
    core.add_request([9, POISON, 9], GREEDY)  # its prefill fails the shared step
    logprobs = []
    while core.has_unfinished_requests():
        logprobs += [out.logprobs for out in core.step() if out.request_id == good.request_id]
    assert len(logprobs) == 3 and all(lp is not None and len(lp[0].top) == 2 for lp in logprobs)


def test_unsampleable_logits_fail_only_their_row(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny)
    real = tiny.model.compute_logits

    def nan_first_row(hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = real(hidden)
        if logits.shape[0] == 2:
            logits[0] = float("nan")
        return logits

    monkeypatch.setattr(tiny.model, "compute_logits", nan_first_row)  # the shared model
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1, seed=1)
    first = core.add_request([5, 6, 7], sampled)
    second = core.add_request([8, 9, 10], GREEDY)
    reasons = drain(core)
    assert reasons == {first.request_id: FinishReason.ERROR, second.request_id: "length"}
    assert second.output_token_ids and first.output_token_ids == []


def test_a_device_that_cannot_compute_stops_the_engine(tiny: LoadedModel) -> None:
    core = make_core(tiny)
    runner = faulty(core)
    core.add_request([5, 6, 7], GREEDY)
    core.step()
    runner.device_ok = False
    with pytest.raises(EngineFaultError, match="illegal memory access"):
        core.step()


def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(
    tiny: LoadedModel,
) -> None:
    core = make_core(tiny)
    vocab = tiny.tokenizer.vocab_size
    for bad in (-1, vocab, 2**64):
        with pytest.raises(Exception, match="outside this model's vocabulary"):
            core.add_request([5, bad], GREEDY)
    assert not core.has_unfinished_requests()
