"""A prompt chunk's attention with float32 queries on the float32 vector tile
(``kernels/paged_prefill_f32.cpp``: a CPU without bfloat16 arithmetic, AVX-512 or AVX2 with
FMA) against plain softmax attention, on a float32 cache and an int8 one; a token's result
does not depend on the chunk it came in; it is the default where it runs, and a path that
cannot run says why."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sendpath.runner.paged_attention import dequantize_rows, quantize_rows
from tests.model.kernels.test_paged_attention import reference
from tests.model.kernels.test_paged_prefill_amx import chunks


def tile_runs(kernel: Any) -> None:
    if kernel.prefill_kernel(9, 3, 64, 16, "float32") != "vector":
        pytest.skip("no float32 prefill tile here: the CPU has neither AVX-512 nor AVX2 with FMA")


@pytest.mark.parametrize("cache", ["float32", "int8"])
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads"),
    [(64, 9, 3), (128, 8, 2), (64, 4, 4), (64, 32, 4), (128, 2, 1)],
)
@pytest.mark.parametrize("bs", [16, 32])
def test_prompt_chunks_on_the_tile_are_softmax_attention(
    kernel: Any, cache: str, head_dim: int, heads: int, kv_heads: int, bs: int
) -> None:
    """Tiles using one to all of their row registers (query head groups of 1 to 8; a
    short chunk's tile fills fewer), across sets of 16 keys, a chunk resuming mid-prompt,
    a decode beside."""
    tile_runs(kernel)
    torch.manual_seed(0)
    blocks = -(-400 // bs) * 4 + 8
    k = torch.randn(kv_heads, blocks * bs, head_dim)
    v = torch.randn_like(k)
    if cache == "int8":
        kc, vc = quantize_rows(k), quantize_rows(v)
        k, v = dequantize_rows(kc, torch.float32), dequantize_rows(vc, torch.float32)
    else:
        kc, vc = k, v
    tables, lens = chunks(blocks, bs)
    q = torch.randn(len(lens), heads, head_dim) * 2  # a sharper softmax
    args = (q, kc, vc, tables, lens, bs, head_dim**-0.5)
    got = kernel.paged_attention(*args, prefill="vector")
    assert got.dtype == torch.float32
    assert torch.allclose(got, reference(q, k, v, tables, lens, bs), atol=1e-5)
    assert torch.allclose(got, kernel.paged_attention(*args, prefill="rows"), atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_chunk_it_came_in(kernel: Any) -> None:
    """Token p's row gives the same bits whether its chunk started at 0, at p - 3 or at p
    (a single row takes the row task: only chunks of 2 tokens or more compared)."""
    tile_runs(kernel)
    torch.manual_seed(1)
    bs, blocks = 16, 32
    k = torch.randn(3, blocks * bs, 64)
    v = torch.randn_like(k)
    table = torch.randperm(blocks)
    q = torch.randn(200, 9, 64)

    def chunk(start: int, end: int) -> torch.Tensor:
        lens = torch.arange(start + 1, end + 1)
        tables = table.expand(end - start, blocks).contiguous()
        out: torch.Tensor = kernel.paged_attention(
            q[start:end], k, v, tables, lens, bs, 0.125, prefill="vector"
        )
        return out

    whole = chunk(0, 200)
    assert torch.equal(chunk(150, 200), whole[150:])
    assert torch.equal(chunk(147, 160), whole[147:160])
    assert torch.equal(chunk(20, 22), whole[20:22])


def test_the_tile_is_the_default_and_a_path_that_cannot_run_says_why(kernel: Any) -> None:
    tile_runs(kernel)
    torch.manual_seed(2)
    k = torch.randn(3, 64 * 16, 64)
    v = torch.randn_like(k)
    tables, lens = chunks(64, 16)
    q = torch.randn(len(lens), 9, 64)
    args = (q, k, v, tables, lens, 16, 0.125)
    assert torch.equal(kernel.paged_attention(*args), kernel.paged_attention(*args, "vector"))
    with pytest.raises(RuntimeError, match=r"take the row task or the vector tile .* not 'amx'"):
        kernel.paged_attention(*args, prefill="amx")
    halves = (k[..., :32].contiguous(), v[..., :32].contiguous())
    with pytest.raises(RuntimeError, match=r"float32 vector prefill tile needs a head dim of 64"):
        kernel.paged_attention(q[..., :32].contiguous(), *halves, tables, lens, 16, 0.125, "vector")
    assert kernel.prefill_kernel(9, 3, 32, 16, "float32") == "rows"  # the shape it lacks
    assert kernel.prefill_kernel(9, 3, 64, 12, "float32") == "rows"
    with pytest.raises(RuntimeError, match="dtype: bfloat16 or float32, not 'float16'"):
        kernel.prefill_kernel(9, 3, 64, 16, "float16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_the_tables_cannot_hold_are_refused(kernel: Any, dtype: torch.dtype) -> None:
    """A context of no tokens (its softmax would divide by nothing) or past its block
    table, or tables and lengths for another number of rows: an error, not a read past."""
    k = torch.randn(3, 8 * 16, 64).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(2, 9, 64).to(dtype)
    tables = torch.tensor([[0, 1], [2, 3]])
    for lens in ([0, 5], [5, 33]):
        with pytest.raises(RuntimeError, match=r"context of .* tokens is not within 1 and its"):
            kernel.paged_attention(q, k, v, tables, torch.tensor(lens), 16, 0.125)
    with pytest.raises(RuntimeError, match="a row per query row"):
        kernel.paged_attention(q, k, v, tables, torch.tensor([5]), 16, 0.125)
    with pytest.raises(RuntimeError, match="a row per query row"):
        kernel.paged_attention(q, k, v, tables[:1], torch.tensor([5, 6]), 16, 0.125)
