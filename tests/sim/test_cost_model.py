"""The roofline: decode is memory-bound, prefill compute-bound, in the right ratios."""

from __future__ import annotations

import pytest

from sendpath.sim.cost_model import Roofline, StepShape
from sendpath.sim.hardware import hardware, model_spec


def test_h200_decodes_1_43x_faster_than_h100_and_prefills_the_same() -> None:
    model = model_spec("llama-3.1-8b")
    h100, h200 = Roofline(model, hardware("H100")), Roofline(model, hardware("H200"))
    decode = StepShape(num_tokens=32, num_seqs=32, context_tokens=32 * 1000, kv_tokens=32 * 1000)
    prefill = StepShape(num_tokens=8192, num_seqs=1, context_tokens=8192 * 4096, kv_tokens=8192)
    overhead = hardware("H100").step_overhead_s
    ratio = (h200.step_seconds(decode) - overhead) / (h100.step_seconds(decode) - overhead)
    assert ratio == pytest.approx(1 / 1.43, rel=0.01)
    assert h200.step_seconds(prefill) == pytest.approx(h100.step_seconds(prefill), rel=0.001)
    # a bigger batch costs little more per step while memory-bound
    one = StepShape(num_tokens=1, num_seqs=1, context_tokens=1000, kv_tokens=1000)
    assert h100.step_seconds(decode) < 1.5 * h100.step_seconds(one)


def test_tensor_parallelism_and_sizes() -> None:
    model, hw = model_spec("llama-3.1-70b"), hardware("H100")
    assert 69e9 < model.params < 72e9 and 7.9e9 < model_spec("llama-3.1-8b").params < 8.1e9
    step = StepShape(num_tokens=64, num_seqs=64, context_tokens=64 * 2000, kv_tokens=64 * 2000)
    tp1, tp4 = Roofline(model, hw, 1).step_seconds(step), Roofline(model, hw, 4).step_seconds(step)
    assert tp1 / 4 < tp4 < tp1 / 2  # faster, less than linearly (all-reduces, overhead)
    with pytest.raises(ValueError, match="tensor parallelism"):
        Roofline(model, hw, 0)


def test_bulk_decode_pricing_is_step_seconds_to_the_last_bit() -> None:
    for model, tp in (("llama-3.1-8b", 1), ("llama-3.1-70b", 4)):
        cost = Roofline(model_spec(model), hardware("H100"), tp)
        context, batch = 5_000, 24
        expected = []
        for _ in range(50):
            context += batch
            expected.append(cost.step_seconds(StepShape(batch, batch, context, context)))
        assert cost.decode_steps(24, 5_000, 50) == expected
