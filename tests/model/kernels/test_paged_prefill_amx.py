"""A prompt chunk's attention on AMX's bfloat16 tiles (``kernels/paged_prefill_amx.h``)
against plain softmax attention, beside the AVX-512 BF16 vector tile it replaces.

The tile kernel runs twice, as block_matmul's AMX designs do: on the tiles (where the CPU
has AMX and Linux grants the tile state) and on ``amx_tiles.h``'s software model of them
(where the CPU has AVX-512 BF16), so its layouts, segments and causal limits are checked on
machines without AMX too; on an AMX machine the tiles are checked against the model, and
the default path must be the tiles."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sendpath.model.quant import cpu_features
from tests.model.kernels.test_paged_attention import reference

PATHS = ["amx-emulated", "amx", "vector"]


def runs_here(kernel: Any, path: str) -> None:
    if path in ("amx-emulated", "vector") and not cpu_features()["avx512_bf16"]:
        pytest.skip(f"the {path} prefill runs on AVX-512 BF16, which this CPU lacks")
    if path == "amx" and not kernel.matrix_loops():
        pytest.skip(f"no AMX here: {kernel.matrix_unavailable()}")


def chunks(blocks: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of prompt chunks: a 300-token prompt from its start (across segments of 256
    keys and several 64-token tasks), a chunk of 70 resuming at 45, a decode between them,
    a 5-token prompt and a 65-token one (a task and one token more)."""
    tables = [torch.randperm(blocks)[: -(-400 // bs)] for _ in range(4)]
    rows = [(tables[0], p + 1) for p in range(300)]
    rows += [(tables[1], p + 1) for p in range(45, 115)]
    rows += [(tables[2], 100)]
    rows += [(tables[2], p + 1) for p in range(5)]
    rows += [(tables[3], p + 1) for p in range(160, 225)]
    return torch.stack([t for t, _ in rows]), torch.tensor([n for _, n in rows])


def inputs(
    head_dim: int, heads: int, kv_heads: int, bs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    blocks = -(-400 // bs) * 4 + 8
    k = torch.randn(kv_heads, blocks * bs, head_dim).bfloat16()
    v = torch.randn_like(k)
    tables, lens = chunks(blocks, bs)
    q = (torch.randn(len(lens), heads, head_dim) * 2).bfloat16()  # sharper softmax
    return q, k, v, tables, lens


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2), (64, 4, 4)])
@pytest.mark.parametrize("bs", [16, 32])
def test_prompt_chunks_on_the_tiles_are_softmax_attention(
    kernel: Any, path: str, head_dim: int, heads: int, kv_heads: int, bs: int
) -> None:
    runs_here(kernel, path)
    q, k, v, tables, lens = inputs(head_dim, heads, kv_heads, bs)
    got = kernel.paged_attention(q, k, v, tables, lens, bs, head_dim**-0.5, prefill=path)
    want = reference(q, k, v, tables, lens, bs)
    assert got.dtype == torch.bfloat16
    error = (got.float() - want).abs().max().item()
    assert error < 2e-2, error


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2)])
def test_the_tiles_give_their_models_results_and_are_the_default(
    kernel: Any, head_dim: int, heads: int, kv_heads: int
) -> None:
    runs_here(kernel, "amx")
    q, k, v, tables, lens = inputs(head_dim, heads, kv_heads, 16)
    scale = head_dim**-0.5
    tiles = kernel.paged_attention(q, k, v, tables, lens, 16, scale, prefill="amx")
    model = kernel.paged_attention(q, k, v, tables, lens, 16, scale, prefill="amx-emulated")
    # the hardware's sums may round in another order than the model's: a bfloat16 step
    assert torch.allclose(tiles.float(), model.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(kernel.paged_attention(q, k, v, tables, lens, 16, scale), tiles)


def test_a_rows_result_does_not_depend_on_the_chunk_it_came_in(kernel: Any) -> None:
    """Token p's row gives the same bits whether its chunk started at 0, at p - 3 or at p
    (a decode's single row takes the row task: only chunks of 2 tokens or more compared)."""
    path = "amx" if kernel.matrix_loops() else "amx-emulated"
    runs_here(kernel, path)
    torch.manual_seed(1)
    bs, blocks = 16, 32
    k = torch.randn(3, blocks * bs, 64).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(blocks)
    q = torch.randn(200, 9, 64).bfloat16()

    def chunk(start: int, end: int) -> torch.Tensor:
        lens = torch.arange(start + 1, end + 1)
        tables = table.expand(end - start, blocks).contiguous()
        out: torch.Tensor = kernel.paged_attention(
            q[start:end], k, v, tables, lens, bs, 0.125, prefill=path
        )
        return out

    whole = chunk(0, 200)
    assert torch.equal(chunk(150, 200), whole[150:])
    assert torch.equal(chunk(147, 160), whole[147:160])


def test_a_path_that_cannot_run_says_why(kernel: Any) -> None:
    q, k, v, tables, lens = inputs(64, 9, 3, 16)
    args = (q, k, v, tables, lens, 16, 0.125)
    with pytest.raises(RuntimeError, match="unknown prefill path 'tiles': rows, vector, amx"):
        kernel.paged_attention(*args, prefill="tiles")
    with pytest.raises(RuntimeError, match="a float32 query's prompt rows take the row task"):
        floats = q.float(), k.float(), v.float()
        kernel.paged_attention(*floats, tables, lens, 16, 0.125, prefill="amx")
    with pytest.raises(RuntimeError, match="q and the cache differ in dtype"):
        kernel.paged_attention(q, k.float(), v.float(), tables, lens, 16, 0.125)
    halves = (k[..., :32].contiguous(), v[..., :32].contiguous())
    odd = (torch.randn(len(lens), 9, 32).bfloat16(), *halves)
    with pytest.raises(RuntimeError, match="a head dim of 64 or 128"):
        kernel.paged_attention(*odd, tables, lens, 16, 0.125, prefill="amx-emulated")
    if not kernel.matrix_loops():
        with pytest.raises(RuntimeError, match=r"the amx prefill does not run on this CPU \("):
            kernel.paged_attention(*args, prefill="amx")
    assert math.isfinite(kernel.paged_attention(*args, prefill="rows").float().sum().item())
