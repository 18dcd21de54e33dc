"""The block-quantized matmul (``kernels/block_matmul.cpp``) against the sum it computes,
written in torch: the activations quantized to int8 per block of 32 (scale = the block's
largest magnitude / 127), each block's integer dot product with the weights' codes, scaled
by both scales, plus the weights' offsets times the activations' quantized sums. Both of
its paths (VNNI where the CPU has it, the portable loop always), four- and eight-bit codes,
a width that is not a multiple of 32, row counts that are not multiples of 16 or of its
four-row tile."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sendpath.model.quant import BlockWeights


def expected(
    x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """x [M, K] and w = d * code + m per block of 32 ([N, K], [N, K/32]) -> [M, N], float64."""
    k = x.shape[1]
    blocks = d.shape[1]
    xp = torch.zeros(x.shape[0], blocks * 32, dtype=torch.float64)
    xp[:, :k] = x.double()
    xb = xp.view(x.shape[0], blocks, 32)
    e = xb.abs().amax(-1) / 127  # [M, B]
    q = torch.where(e[..., None] > 0, xb / e[..., None].clamp(min=1e-300), 0).round()
    cp = torch.zeros(codes.shape[0], blocks * 32, dtype=torch.float64)
    cp[:, :k] = codes.double()
    cb = cp.view(codes.shape[0], blocks, 32)
    dots = torch.einsum("mbi,nbi->mnb", q, cb)  # integer dot products per block
    scaled = dots * e[:, None, :] * d.double()[None]
    offsets = (e * q.sum(-1))[:, None, :] * m.double()[None]
    return (scaled + offsets).sum(-1)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(37, 200), (64, 96)])
def test_four_bit_codes(kernel: Any, portable: bool, dtype: torch.dtype, n: int, k: int) -> None:
    if not portable and not kernel.has_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU: only the portable loop runs here")
    torch.manual_seed(0)
    blocks = -(-k // 32)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    # float16 scales and minimums, as GGUF stores them (the packed layout keeps them so)
    d = (torch.rand(n, blocks) * 0.02).half().float()
    m = (-torch.rand(n, blocks) * 0.1).half().float()
    packed = kernel.pack_q4(codes, d, m)
    for rows in (1, 3, 6, 9, 15, 21):  # every remainder of the kernel's 8-row tiles
        x = torch.randn(rows, k).to(dtype)
        got = kernel.block_matmul(x, *packed, n, portable=portable)
        want = expected(x, codes, d, m)
        assert got.shape == (rows, n) and got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance), rows


@pytest.mark.parametrize("portable", [False, True])
def test_eight_bit_codes(kernel: Any, portable: bool) -> None:
    if not portable and not kernel.has_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU: only the portable loop runs here")
    torch.manual_seed(1)
    n, k = 50, 160
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = (torch.rand(n, k // 32) * 0.01).half().float()  # float16, as Q8_0 stores it
    packed = kernel.pack_q8(codes, d)
    x = torch.randn(5, k)
    got = kernel.block_matmul(x, *packed, n, portable=portable)
    assert torch.allclose(
        got.double(), expected(x, codes, d, torch.zeros_like(d)), rtol=1e-4, atol=1e-4
    )


def test_q8_0_weights_round_trip_their_own_codes(kernel: Any) -> None:
    """A weight that came from Q8_0 (codes times a scale per block, the largest code 127)
    is quantized back to the same codes: its products are the file's own."""
    if not kernel.has_vnni():
        pytest.skip("BlockWeights runs on AVX-512 VNNI only")
    torch.manual_seed(2)
    codes = torch.randint(-127, 128, (16, 64)).float()
    codes[:, 0], codes[:, 32] = 127, -127  # every block's largest magnitude is 127
    d = (torch.rand(16, 2) * 0.01).half().float()  # Q8_0's scales are float16
    weight = (codes.view(16, 2, 32) * d[..., None]).view(16, 64)
    weights = BlockWeights.q8_0(kernel, weight)
    assert torch.allclose(weights.dequantize(), weight, rtol=1e-5, atol=1e-7)


def test_bad_shapes_are_refused(kernel: Any) -> None:
    packed = kernel.pack_q4(
        torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    with pytest.raises(RuntimeError, match="do not fit the input width"):
        kernel.block_matmul(torch.randn(1, 128), *packed, 16)
    with pytest.raises(RuntimeError, match="below 16"):
        kernel.pack_q4(
            torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1)
        )
