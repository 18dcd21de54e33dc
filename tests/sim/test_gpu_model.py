"""The GPU step model's terms on cases worked out by hand."""

from __future__ import annotations

import pytest

from sendpath.engine.steps import StepShape
from sendpath.sim.gpu_model import Efficiency, GpuStep
from sendpath.sim.hardware import hardware, model_spec

LLAMA = model_spec("llama-3.1-8b")  # 32 layers, 4096 hidden, 8 kv heads of 128
H100 = hardware("H100")  # 989e12 bf16 FLOP/s, 1979e12 fp8, 3.35e12 B/s, 450e9 B/s link
PARAMS = LLAMA.params
KV_TOKEN = 2 * 32 * 8 * 128 * 2  # bytes of K and V a token, bf16


def decode(seqs: int, context: int) -> StepShape:
    """``seqs`` decodes, each at ``context`` tokens before its new one."""
    return StepShape(seqs, seqs, seqs * (context + 1), seqs * (context + 1))


def prefill(tokens: int) -> StepShape:
    return StepShape(tokens, 1, tokens * (tokens + 1) // 2, tokens, tokens, 1)


def test_a_small_decode_streams_the_weights_and_its_kv() -> None:
    eff = Efficiency(compute=0.5, memory=0.8, step_s=0.002, seq_s=1e-5)
    got = GpuStep(LLAMA, H100, efficiency=eff).step_seconds(decode(4, 1000))
    read = 2 * PARAMS + KV_TOKEN * (4 * 1001 + 4)  # weights once, each context, the new tokens
    assert got == pytest.approx(read / (3.35e12 * 0.8) + 0.002 + 4e-5, rel=1e-9)


def test_a_prefill_reaches_its_compute_share_as_its_tokens_grow() -> None:
    def seconds(half: float) -> float:
        eff = Efficiency(compute=0.6, half_tokens=half, step_s=0.0)
        return GpuStep(LLAMA, H100, efficiency=eff).step_seconds(prefill(2000))

    linear = 2 * PARAMS * 2000 / (989e12 * 0.6)
    attention = 4 * 32 * 4096 * (2000 * 2001 // 2) / (989e12 * 0.6)
    assert seconds(0) == pytest.approx(linear + attention, rel=1e-9)
    # at half_tokens = 2000 a 2,000-token step reaches half the share: its matmuls take twice
    assert seconds(2000) == pytest.approx(2 * linear + attention, rel=1e-9)


def test_fp8_weights_halve_the_bytes_and_use_the_fp8_peak() -> None:
    eff = Efficiency(step_s=0.0)
    bf16, fp8 = (GpuStep(LLAMA, H100, 1, p, eff) for p in ("bf16", "fp8"))
    one = decode(1, 0)
    kv = KV_TOKEN * 2 / (3.35e12 * 0.8)
    assert fp8.step_seconds(one) - kv == pytest.approx((bf16.step_seconds(one) - kv) / 2)
    big = prefill(8192)
    attention = 4 * 32 * 4096 * (8192 * 8193 // 2) / (989e12 * 0.5)
    linear = 2 * PARAMS * 8192 / (989e12 * 0.5)
    assert bf16.step_seconds(big) == pytest.approx(linear + attention, rel=1e-9)
    fp8_linear = 2 * PARAMS * 8192 / (1979e12 * 0.5)  # the fp8 peak; attention stays bf16
    assert fp8.step_seconds(big) == pytest.approx(fp8_linear + attention, rel=1e-9)
    with pytest.raises(ValueError, match="A100-80GB-SXM has no fp8 tensor cores"):
        GpuStep(LLAMA, hardware("A100"), precision="fp8")
    with pytest.raises(ValueError, match="precision is one of bf16, fp16, fp8"):
        GpuStep(LLAMA, H100, precision="int4")


def test_tensor_parallelism_splits_the_work_and_adds_all_reduces() -> None:
    eff = Efficiency(step_s=0.0, link_latency_s=5e-6)
    one, two = GpuStep(LLAMA, H100, 1, efficiency=eff), GpuStep(LLAMA, H100, 2, efficiency=eff)
    step = decode(8, 500)
    tokens = 8
    data = 2 * 4096 * 2 * (2 - 1) / 2  # a token's bf16 activations, ring over 2 devices
    reduces = 2 * 32 * 5e-6 + 2 * 32 * data * tokens / 450e9
    assert two.step_seconds(step) == pytest.approx(one.step_seconds(step) / 2 + reduces)
    with pytest.raises(ValueError, match="no link between devices"):
        GpuStep(LLAMA, hardware("cpu"), 2)


def test_an_empty_step_costs_its_overhead_and_bad_shares_are_refused() -> None:
    eff = Efficiency(step_s=0.003)
    assert GpuStep(LLAMA, H100, efficiency=eff).step_seconds(StepShape(0, 0, 0, 0)) == 0.003
    with pytest.raises(ValueError, match="shares in"):
        Efficiency(compute=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        Efficiency(step_s=-1)
