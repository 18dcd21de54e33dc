"""The C++ layer stack against the model's own modules: the same hidden states and the
same cache, to the bit, on prompt chunks and on a step of decodes (the paged cache read in
place), and with the attention backend called back where it has no kernel; with a
Qwen2-style bias too; models it cannot run keep the modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from sendpath.engine.core import EngineCore
from sendpath.model.layer_stack import layer_stack, use_kernels
from sendpath.model.llama import DecoderLayer, RMSNorm
from sendpath.model.loader import LoadedModel, load_model
from sendpath.model.quant import block_kernels
from sendpath.request import SamplingParams
from sendpath.runner.model_runner import ModelRunner
from tests.engine.test_core import make_core


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def quantized(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[LoadedModel]:
    """The tiny model on four-bit block weights, with bfloat16 or float32 activations."""
    if block_kernels() is None:
        pytest.skip("the layer stack runs block-quantized weights: AVX-512 VNNI or AVX2 only")
    yield load_model(tiny_llama_dir, dtype=request.param, quantization="int4")


def layers(loaded: LoadedModel) -> list[DecoderLayer]:
    return [layer for layer in loaded.model.layers if isinstance(layer, DecoderLayer)]


def forward_both(core: EngineCore) -> tuple[torch.Tensor, torch.Tensor]:
    """The next step's hidden states through the stack, then through the modules, each
    from the same cache; asserts both leave the same cache."""
    runner = core.runner
    assert isinstance(runner, ModelRunner)
    model, attention = runner.model, runner.attention
    plan = core.scheduler.schedule()
    ids = torch.tensor([t for item in plan.requests for t in item.token_ids])
    spans = [range(item.start_pos, item.start_pos + item.num_tokens) for item in plan.requests]
    positions = torch.tensor([p for span in spans for p in span])
    attention.prepare(plan.requests, torch.device("cpu"))
    caches = runner.k_cache.clone(), runner.v_cache.clone()
    stack = model.stack
    assert stack is not None
    with torch.inference_mode():
        fast = model(ids, positions, attention)
        written = runner.k_cache.clone(), runner.v_cache.clone()
        runner.k_cache.copy_(caches[0])
        runner.v_cache.copy_(caches[1])
        model.stack = None
        try:
            slow = model(ids, positions, attention)
        finally:
            model.stack = stack
    assert torch.equal(written[0], runner.k_cache) and torch.equal(written[1], runner.v_cache)
    return fast, slow


def test_the_stack_is_the_modules_to_the_bit(quantized: LoadedModel) -> None:
    core = make_core(quantized)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for prompt in ([5, 6, 7], list(range(100, 160)), [9] * 20):
        core.add_request(prompt, params)
    attention = core.runner.attention  # type: ignore[attr-defined]
    fast, slow = forward_both(core)  # the prompts' chunks: the paged cache read in place
    assert torch.equal(fast, slow) and attention.paged() is not None
    kernel, attention.kernel = attention.kernel, None
    try:
        fast, slow = forward_both(core)  # no kernel: the attention backend called back
        assert torch.equal(fast, slow) and attention.paged() is None
    finally:
        attention.kernel = kernel
    core.step()  # the same plan, now run: every request has its first token
    while core.scheduler.waiting:
        core.step()
    fast, slow = forward_both(core)  # decodes only
    assert torch.equal(fast, slow) and fast.shape[0] == 3


def test_a_qkv_bias_rides_along(quantized: LoadedModel) -> None:
    model, kernels = quantized.model, block_kernels()
    for layer in layers(quantized):
        size = layer.self_attn.q_size + 2 * layer.self_attn.kv_size
        bias = torch.randn(size, dtype=quantized.model.dtype) * 0.1
        layer.self_attn.qkv_bias = nn.Parameter(bias)
    try:
        use_kernels(model, kernels)
        core = make_core(quantized)
        core.add_request(list(range(30, 70)), SamplingParams(max_tokens=4, ignore_eos=True))
        fast, slow = forward_both(core)
        assert torch.equal(fast, slow)
    finally:
        for layer in layers(quantized):
            layer.self_attn.qkv_bias = None
        use_kernels(model, kernels)


def test_the_engine_answers_the_same_with_and_without_it(quantized: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 160)), list(range(300, 333)), [9] * 20]

    def run() -> list[list[int]]:
        core = make_core(quantized, max_num_batched_tokens=32)  # chunks beside decodes
        requests = [core.add_request(p, params) for p in prompts]
        while core.has_unfinished_requests():
            core.step()
        return [r.output_token_ids for r in requests]

    stack = quantized.model.stack
    assert stack is not None
    with_stack = run()
    quantized.model.stack = None
    try:
        assert with_stack == run()
    finally:
        quantized.model.stack = stack


def test_models_it_cannot_run_keep_their_modules(quantized: LoadedModel, tiny: LoadedModel) -> None:
    kernels = block_kernels()
    make_core(tiny)  # float32, dense weights: the modules' path
    assert tiny.model.stack is None and layer_stack(tiny.model, kernels) is None
    attn = layers(quantized)[0].self_attn
    attn.q_norm = RMSNorm(attn.head_dim, 1e-6)  # Qwen3's per-head norms
    try:
        assert layer_stack(quantized.model, kernels) is None
    finally:
        attn.q_norm = None
