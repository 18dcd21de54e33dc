"""Low-precision weights: the GGUF four-bit codes read exactly, the CPU kernels against the
float32 product on the same weights, and ``Linear`` choosing by the number of rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sendpath.errors import ModelLoadError
from sendpath.model.linear import Linear
from sendpath.model.llama import LlamaConfig, LlamaModel
from sendpath.model.loader import load_model
from sendpath.model.precision import apply_precision, choose_precision
from sendpath.model.quant import (
    BlockWeights,
    Int4Weights,
    Int8Weights,
    block_kernels,
    int4_supported,
    native_bf16,
    q4_0_codes,
    q4_1_codes,
    q4_weight,
    quantize_q4,
)

pytestmark = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")


Read = Callable[[np.ndarray[Any, Any]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _weights(n: int = 96, k: int = 128, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32)


@pytest.mark.parametrize(
    ("kind", "read"),
    [(GGMLQuantizationType.Q4_1, q4_1_codes), (GGMLQuantizationType.Q4_0, q4_0_codes)],
)
def test_gguf_four_bit_codes_are_read_exactly(kind: GGMLQuantizationType, read: Read) -> None:
    w = _weights()
    raw = quantize(w, kind)
    codes, d, m = read(raw)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    rebuilt = codes.float().view(96, 4, 32) * d[..., None] + m[..., None]
    assert torch.equal(rebuilt.view(96, 128), torch.from_numpy(dequantize(raw, kind)))
    # the loader's values, to the bit, at scales from half precision's least to 10,000
    scales = np.array([6e-8, 1e-3, 0.37, 1.0, 3.1e2, 1e4], np.float16).astype(np.float32)
    wide = (_weights(n=6, k=128, seed=1) * scales[:, None]).astype(np.float32)
    raw = quantize(wide, kind)
    values = q4_weight(*read(raw), kind == GGMLQuantizationType.Q4_0)
    assert values.dtype == np.float32
    assert np.array_equal(values.view(np.uint32), dequantize(raw, kind).view(np.uint32))


def test_the_int4_kernel_multiplies_by_the_files_own_weights() -> None:
    w = _weights()
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    int4 = Int4Weights.from_q4_1(*q4_1_codes(raw), torch.bfloat16)
    # the only rounding is the per-group (scale, zero) to bfloat16
    assert (int4.dequantize() - exact).abs().max() < 0.01 * exact.abs().max()
    x = torch.randn(3, 128)
    got = int4.matmul(x.bfloat16()).float()
    want = x @ int4.dequantize().t()
    assert torch.allclose(got, want, rtol=0.02, atol=0.05 * want.abs().max().item())


def test_int8_weights_and_codes_made_here() -> None:
    w = torch.from_numpy(_weights(64, 96))
    int8 = Int8Weights.from_dense(w, torch.bfloat16)
    x = torch.randn(2, 96)
    assert torch.allclose(int8.matmul(x.bfloat16()).float(), x @ w.t(), rtol=0.05, atol=0.3)
    codes, d, m = quantize_q4(w)  # for a model without four-bit weights: an approximation
    rebuilt = (codes.float().view(64, 3, 32) * d[..., None] + m[..., None]).view(64, 96)
    assert (rebuilt - w).abs().max() <= d.max() / 2 + 1e-6


def test_linear_uses_the_quantized_weights_for_few_rows_only() -> None:
    linear = Linear(128, 96)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(_weights()))
    linear.weight.data = linear.weight.data.bfloat16()
    calls: list[int] = []

    class Spy(Int8Weights):
        def matmul(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().matmul(x)

    int8 = Int8Weights.from_dense(linear.weight_out_in, torch.bfloat16)
    linear.use_quantized(Spy(int8.codes, int8.scales), max_rows=4)
    for rows in (1, 4, 5, 64):
        linear(torch.randn(rows, 128).bfloat16())
    assert calls == [1, 4]  # 5 and 64 rows: the dense weight


def test_a_weight_quantized_for_every_product_can_drop_its_dense_copy() -> None:
    linear = Linear(128, 96)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(_weights()))
    int8 = Int8Weights.from_dense(linear.weight_out_in, torch.float32)
    with pytest.raises(ValueError, match="every product"):
        linear.drop_dense()  # nothing quantized yet
    linear.use_quantized(int8, max_rows=4)
    with pytest.raises(ValueError, match="every product"):
        linear.drop_dense()  # larger products still need it
    linear.use_quantized(int8, max_rows=None)
    linear.drop_dense()
    assert linear.weight.is_meta and not linear.serves_dense
    linear.use_packed_layout()  # nothing to pack: a no-op
    assert linear.packed is None
    x = torch.randn(64, 128)
    assert torch.equal(linear(x), int8.matmul(x))


def test_packed_weights_give_the_dense_products_and_replace_the_dense_copy() -> None:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch has no oneDNN")
    if not native_bf16():  # oneDNN's bfloat16 layout needs AVX-512 (the loader asks the same)
        pytest.skip("no native bfloat16 here: the packed bfloat16 layout is not used")
    linear = Linear(128, 96)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(_weights()))
    linear.weight.data = linear.weight.data.bfloat16()
    dense = linear.weight.detach().clone()
    x = {rows: torch.randn(rows, 128).bfloat16() for rows in (1, 8, 33)}
    expected = {rows: torch.nn.functional.linear(v, dense) for rows, v in x.items()}
    linear.use_packed_layout()
    assert linear.weight.device.type == "meta" and linear.weight.shape == (96, 128)
    assert torch.equal(linear.weight_out_in, dense)  # unpacked on demand, exactly
    for rows, v in x.items():
        assert torch.equal(linear(v), expected[rows])


def test_auto_precision_on_the_built_in_model_is_the_files_four_bits() -> None:
    native = native_bf16()
    blocks = block_kernels()
    if blocks is None and not native:
        pytest.skip("auto keeps float32 weights here: no AVX2 or VNNI kernels, no native bfloat16")
    loaded = load_model(None, dtype="auto", quantization="auto")
    want_dtype = "bfloat16" if native else "float32"
    assert loaded.precision.dtype == want_dtype and loaded.precision.quantization == "int4"
    assert "four-bit" in loaded.precision.reason
    qkv = next(m for n, m in loaded.model.named_modules() if n.endswith("0.self_attn.qkv_proj"))
    assert isinstance(qkv, Linear)
    if blocks is not None:  # AVX-512 VNNI or AVX2: llama.cpp's way, the head's Q8_0 too
        loop = {"avx512-vnni": "AVX-512 VNNI", "avx2": "AVX2"}[blocks.block_loops()[0]]
        assert f"on {loop}" in loaded.precision.reason
        assert isinstance(qkv.quantized, BlockWeights)
        assert isinstance(loaded.model.lm_head.quantized, BlockWeights)
        # they serve every product, a prompt chunk's too, and the dense copy is gone
        assert qkv.quantized_rows is None and qkv.weight.is_meta and qkv.packed is None
        with pytest.raises(ValueError, match="dropped"):
            qkv.weight_out_in  # noqa: B018
        # the tied head keeps its dense weight: it is the embedding
        assert torch.equal(loaded.model.lm_head.weight_out_in, loaded.model.embed_tokens.weight)
    else:
        assert isinstance(qkv.quantized, Int4Weights)
        assert isinstance(loaded.model.lm_head.quantized, Int8Weights)


def test_float32_asked_for_keeps_float32_weights_and_from_auto_takes_the_files() -> None:
    cpu = torch.device("cpu")
    asked = choose_precision("auto", "float32", cpu, ships_q4=True, dtype_asked=True)
    assert asked.quantization == "none" and "float32 asked for" in asked.reason
    chosen = choose_precision("auto", "float32", cpu, ships_q4=True, dtype_asked=False)
    if block_kernels() is None:
        assert chosen.quantization == "none"
    else:  # AVX2 without native bfloat16: the four-bit kernels with float32 activations
        assert chosen.quantization == "int4" and "float32 activations" in chosen.reason


def test_block_weights_free_every_dense_copy_but_a_tied_heads() -> None:
    if block_kernels() is None:
        pytest.skip("no AVX-512 VNNI or AVX2 here (or no compiler): torch's int4 kernel runs")
    for tied in (True, False):
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                             num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                             tie_word_embeddings=tied)  # fmt: skip
        torch.manual_seed(0)
        model = LlamaModel(config)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.05)
        hidden = torch.randn(3, 64)
        dense = hidden @ model.lm_head.weight_out_in.t()
        precision = choose_precision("int4", "float32", torch.device("cpu"), ships_q4=False)
        apply_precision(model, precision, {}, torch.device("cpu"))
        qkv = next(m for n, m in model.named_modules() if n.endswith("qkv_proj"))
        assert isinstance(qkv, Linear) and qkv.weight.is_meta
        assert isinstance(qkv.quantized, BlockWeights)
        assert model.lm_head.weight.is_meta is not tied  # tied, it is the embedding
        assert torch.allclose(model.compute_logits(hidden), dense, atol=0.02)


def test_block_weights_are_the_files_own_codes() -> None:
    kernels = block_kernels()
    if kernels is None:
        pytest.skip("no AVX-512 VNNI or AVX2 here (or no compiler): torch's int4 kernel runs")
    raw = quantize(_weights(), GGMLQuantizationType.Q4_1)
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    weights = BlockWeights.from_q4_1(kernels, *q4_1_codes(raw))
    # no rounding of the weights at all; the activations' int8 per block is the only one
    assert torch.allclose(weights.dequantize(), exact, rtol=1e-6, atol=1e-6)
    x = torch.randn(3, 128)
    got, want = weights.matmul(x), x @ exact.t()
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))


def test_quantization_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ModelLoadError, match="bfloat16 activations"):
        load_model(None, dtype="float32", quantization="int8")
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(None, quantization="int3")
