"""The block-quantized matmul (``kernels/block_matmul.cpp``) against the sum it computes,
written in torch: the activations quantized to int8 per block of 32 (scale = the block's
largest magnitude / 127), each block's integer dot product with the weights' codes, scaled
by both scales, plus the weights' offsets times the activations' quantized sums. Each of
its loops that runs here (AVX-512 VNNI, AVX2, the portable loop always), four- and eight-bit
codes, a width that is not a multiple of 32, row counts that are not multiples of 16 or of
its row tiles."""

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


LOOPS = ["avx512-vnni", "avx2", "portable"]


def runs_here(kernel: Any, loop: str) -> None:
    if loop not in kernel.block_loops():
        pytest.skip(f"the {loop} loop does not run on this CPU ({kernel.block_loops()} do)")


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(37, 200), (64, 96)])
def test_four_bit_codes(kernel: Any, loop: str, dtype: torch.dtype, n: int, k: int) -> None:
    runs_here(kernel, loop)
    torch.manual_seed(0)
    blocks = -(-k // 32)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    # float16 scales and minimums, as GGUF stores them (the packed layout keeps them so)
    d = (torch.rand(n, blocks) * 0.02).half().float()
    m = (-torch.rand(n, blocks) * 0.1).half().float()
    packed = kernel.pack_q4(codes, d, m)
    for rows in (1, 3, 6, 9, 15, 21):  # every remainder of the kernel's 8-row tiles
        x = torch.randn(rows, k).to(dtype)
        got = kernel.block_matmul(x, *packed, n, loop=loop)
        want = expected(x, codes, d, m)
        assert got.shape == (rows, n) and got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance), rows


@pytest.mark.parametrize("loop", LOOPS)
def test_eight_bit_codes(kernel: Any, loop: str) -> None:
    runs_here(kernel, loop)
    torch.manual_seed(1)
    n, k = 50, 160
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    codes[0, :32] = 127  # the extremes, whose products overflow int16 if summed as they are
    codes[1, :32] = -127
    d = (torch.rand(n, k // 32) * 0.01).half().float()  # float16, as Q8_0 stores it
    packed = kernel.pack_q8(codes, d)
    for rows in (1, 5):
        x = torch.randn(rows, k)
        x[:, :32] = x[:, :32].abs() * x[0, 0].sign()  # one sign a block: the largest sums
        got = kernel.block_matmul(x, *packed, n, loop=loop)
        assert torch.allclose(
            got.double(), expected(x, codes, d, torch.zeros_like(d)), rtol=1e-4, atol=1e-4
        )


def test_the_loops_agree_to_the_bit_on_their_codes(kernel: Any) -> None:
    """Every loop quantizes the activations alike (rounding half to even), so their integer
    sums are the same; only the float sums' order differs."""
    torch.manual_seed(3)
    n, k = 48, 320
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.02).half().float()
    packed = kernel.pack_q4(codes, d, torch.zeros(n, k // 32))
    x = (torch.randn(7, k) * 4).round() / 4  # many ties at half a code
    results = [kernel.block_matmul(x, *packed, n, loop=loop) for loop in kernel.block_loops()]
    for got in results[1:]:
        assert torch.allclose(got, results[0], rtol=1e-5, atol=1e-5)


def test_a_loop_that_does_not_run_here_is_refused(kernel: Any) -> None:
    packed = kernel.pack_q4(
        torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        kernel.block_matmul(torch.randn(1, 64), *packed, 16, loop="sse")


def test_q8_0_weights_round_trip_their_own_codes(kernel: Any) -> None:
    """A weight that came from Q8_0 (codes times a scale per block, the largest code 127)
    is quantized back to the same codes: its products are the file's own."""
    if kernel.block_loops()[0] == "portable":
        pytest.skip("BlockWeights runs on AVX-512 VNNI or AVX2 only")
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
