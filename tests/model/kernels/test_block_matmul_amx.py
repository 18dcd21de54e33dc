"""block_matmul's AMX designs (``kernels/block_matmul_amx.h``): int8 tiles equal to the
AVX-512 VNNI loop to the bit, bfloat16 tiles within bfloat16's precision of the exact sum.

Each runs twice: on the tiles (where the CPU has AMX and Linux grants the tile state) and
on ``amx_tiles.h``'s software model of them (where the CPU has AVX-512 BF16: Zen 4 and
later, Xeons since Cooper Lake), so the layouts, tile shapes and fix-ups are checked on
machines without AMX too; the test on the tiles then checks the model against them."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from sendpath.model.quant import cpu_features, matrix_engine

EMULATED = ["amx-int8-emulated", "amx-bf16-emulated"]
TILES = ["amx-bf16", "amx-int8"]  # the default's first
ROWS = (1, 15, 16, 17, 40)  # below, at and past one 16-row tile; two tiles and a part


def runs_here(kernel: Any, loop: str) -> None:
    if loop in EMULATED:
        if not cpu_features()["avx512_bf16"]:
            pytest.skip("the AMX model runs on AVX-512 BF16, which this CPU lacks")
    elif loop not in kernel.matrix_loops():
        pytest.skip(f"no AMX here: {kernel.matrix_unavailable()}")


def vnni(kernel: Any) -> None:
    if "avx512-vnni" not in kernel.block_loops():
        pytest.skip("the AVX-512 VNNI loop, which the int8 tiles match, does not run here")


def weights(kernel: Any, four_bit: bool, n: int, k: int) -> tuple[Any, torch.Tensor]:
    """Random packed weights and their dense [n, k] float32 values."""
    blocks = -(-k // 32)
    d = (torch.rand(n, blocks) * 0.02).half().float()
    padded = torch.zeros(n, blocks * 32)
    if four_bit:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        m = (-torch.rand(n, blocks) * 0.1).half().float()
        packed = kernel.pack_q4(codes, d, m)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        m = torch.zeros(n, blocks)
        packed = kernel.pack_q8(codes, d)
    padded[:, :k] = codes.float()
    dense = padded.view(n, blocks, 32) * d[..., None] + m[..., None]
    return packed, dense.view(n, -1)[:, :k]


@pytest.mark.parametrize("loop", ["amx-int8-emulated", "amx-int8"])
@pytest.mark.parametrize("four_bit", [True, False])
@pytest.mark.parametrize(("n", "k"), [(37, 200), (48, 1536)])
def test_int8_tiles_equal_the_vnni_loop_to_the_bit(
    kernel: Any, loop: str, four_bit: bool, n: int, k: int
) -> None:
    """So a step's rows may take either path: batching does not change a request's output."""
    runs_here(kernel, loop)
    vnni(kernel)
    torch.manual_seed(0)
    packed, _ = weights(kernel, four_bit, n, k)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            got = kernel.block_matmul(x, *packed, n, loop=loop)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert torch.equal(got, kernel.block_matmul(x, *packed, n, loop="avx512-vnni")), rows


@pytest.mark.parametrize("loop", ["amx-bf16-emulated", "amx-bf16"])
@pytest.mark.parametrize("four_bit", [True, False])
@pytest.mark.parametrize(("n", "k"), [(37, 200), (64, 576)])
def test_bf16_tiles_hold_bfloat16_precision(
    kernel: Any, loop: str, four_bit: bool, n: int, k: int
) -> None:
    """Weights and activations rounded to bfloat16 once, float32 sums over all of K: each
    output within 1% of the largest exact one (the int8 loops keep about the same)."""
    runs_here(kernel, loop)
    torch.manual_seed(1)
    packed, dense = weights(kernel, four_bit, n, k)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            exact = x.double() @ dense.double().T
            got = kernel.block_matmul(x, *packed, n, loop=loop)
            assert got.dtype == dtype and got.shape == (rows, n)
            error = (got.double() - exact).abs().max() / exact.abs().max()
            assert error < 0.01, (rows, float(error))


@pytest.mark.parametrize("design", ["int8", "bf16"])
def test_the_tiles_compute_what_their_model_computes(kernel: Any, design: str) -> None:
    """On an AMX machine: the hardware against the model the other tests check."""
    runs_here(kernel, f"amx-{design}")
    runs_here(kernel, f"amx-{design}-emulated")
    torch.manual_seed(2)
    packed, _ = weights(kernel, True, 80, 576)
    x = torch.randn(33, 576)
    tiles = kernel.block_matmul(x, *packed, 80, loop=f"amx-{design}")
    model = kernel.block_matmul(x, *packed, 80, loop=f"amx-{design}-emulated")
    if design == "int8":
        assert torch.equal(tiles, model)
    else:  # the same products; the hardware may round its float32 sums otherwise
        assert torch.allclose(tiles, model, rtol=1e-4, atol=1e-5)


def test_where_the_tiles_cannot_run_a_loop_on_them_says_why(kernel: Any) -> None:
    reason = kernel.matrix_unavailable()
    assert (reason == "") == bool(kernel.matrix_loops())
    if not reason:
        assert kernel.matrix_loops() == TILES
        bf16, int8 = kernel.matrix_min_rows()
        assert bf16 > int8 >= 16  # a tile's rows
        described = f"amx-bf16 tiles from {bf16} rows a step, amx-int8 from {int8}"
        assert matrix_engine(kernel) == described
        return
    assert matrix_engine(kernel) == f"none: {reason}"
    packed = kernel.pack_q4(
        torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    for loop in TILES:
        with pytest.raises(RuntimeError, match=re.escape(f"does not run on this CPU ({reason})")):
            kernel.block_matmul(torch.randn(16, 64), *packed, 16, loop=loop)


def test_the_default_takes_each_tile_design_from_its_rows_and_the_vector_loop_below(
    kernel: Any,
) -> None:
    runs_here(kernel, "amx-bf16")
    vnni(kernel)
    torch.manual_seed(3)
    packed, _ = weights(kernel, True, 64, 576)
    bf16, int8 = kernel.matrix_min_rows()
    for n, loop in (
        (int8 - 1, "avx512-vnni"),
        (int8, "amx-int8"),
        (bf16 - 1, "amx-int8"),
        (bf16, "amx-bf16"),
        (bf16 + 17, "amx-bf16"),
    ):
        x = torch.randn(n, 576).bfloat16()
        want = kernel.block_matmul(x, *packed, 64, loop=loop)
        assert torch.equal(kernel.block_matmul(x, *packed, 64), want), (n, loop)
