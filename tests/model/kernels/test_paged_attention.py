"""The paged attention kernel against plain softmax attention, on both of the paths this CPU
has (AVX-512, or AVX2 without it, for head dims 64 and 128; the portable loop otherwise,
and on AVX2 for a block size not a multiple of 8), and on prompt chunks' rows
(a bfloat16 cache takes them a tile at a time); the runner's attention
backend with it against torch's attention, on prompt chunks and decodes; and the CPU kernels
in the engine, where they must give the tokens torch's ops give."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sendpath.engine.core import EngineCore
from sendpath.engine.scheduler import ScheduledRequest
from sendpath.model.loader import LoadedModel
from sendpath.request import SamplingParams
from sendpath.runner.paged_attention import PagedAttention, dequantize_rows, quantize_rows
from tests.engine.test_core import make_core


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    bs: int,
) -> torch.Tensor:
    """Softmax attention of each sequence's query over its context, gathered by slot."""
    out = []
    group = q.shape[1] // k.shape[0]
    for b, length in enumerate(lens.tolist()):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(length)])
        keys = k[:, slots].float().repeat_interleave(group, 0)  # [H, L, D]
        values = v[:, slots].float().repeat_interleave(group, 0)
        scores = (q[b].float()[:, None, :] @ keys.transpose(1, 2))[:, 0] / math.sqrt(q.shape[2])
        out.append(torch.softmax(scores, -1)[:, None, :] @ values)
    return torch.stack(out)[:, :, 0]  # [B, H, D]


def rows_of(layout: str, blocks: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows' block tables and context lengths: scattered sequences' decodes, or prompt
    chunks' consecutive positions (several tiles of one) with decodes among them."""
    if layout == "sequences":
        lens = torch.tensor([1, 16, 17, 63, 64, 65, 150])  # inside a block, at its end, past it
        return torch.stack([torch.randperm(blocks)[: -(-150 // bs)] for _ in lens]), lens
    first, second = (torch.randperm(blocks)[: -(-150 // bs)] for _ in range(2))
    rows = [(first, p + 1) for p in range(45, 115)]  # a chunk resuming at 45
    rows += [(second, 100)]  # a decode between chunks
    rows += [(second, p + 1) for p in range(5)]  # a short chunk starting a prompt
    rows += [(first, 120), (first, 121)]  # two rows of one sequence, not one chunk: the same
    return torch.stack([t for t, _ in rows]), torch.tensor([n for _, n in rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2), (16, 4, 2), (64, 4, 4)]
)
@pytest.mark.parametrize("bs", [16, 8, 32, 12])
@pytest.mark.parametrize("layout", ["sequences", "chunks"])
def test_the_kernel_is_softmax_attention_over_each_rows_blocks(
    kernel: Any, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, bs: int, layout: str
) -> None:
    torch.manual_seed(0)
    blocks = 64
    k = torch.randn(kv_heads, blocks * bs, head_dim).to(dtype)
    v = torch.randn_like(k)
    tables, lens = rows_of(layout, blocks, bs)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    got = kernel.paged_attention(q, k, v, tables, lens, bs, head_dim**-0.5)
    want = reference(q, k, v, tables, lens, bs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 8, 2), (16, 4, 2)])
@pytest.mark.parametrize("bs", [16, 12])
@pytest.mark.parametrize("layout", ["sequences", "chunks"])
@pytest.mark.parametrize("prefill", ["", "rows"])
def test_an_int8_cache_is_attended_as_its_dequantized_values(
    kernel: Any,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    kv_heads: int,
    bs: int,
    layout: str,
    prefill: str,
) -> None:
    """`--kv-cache-dtype int8`: rows of codes and a scale, read by the row task, or for a
    prompt chunk's rows by the prompt tiles (bfloat16 queries: on a bfloat16 copy; float32
    ones: a set of keys dequantized at a time)."""
    torch.manual_seed(0)
    blocks = 64
    k = quantize_rows(torch.randn(kv_heads, blocks * bs, head_dim))
    v = quantize_rows(torch.randn(kv_heads, blocks * bs, head_dim))
    assert k.dtype == torch.int8 and k.shape[-1] == head_dim + 4
    tables, lens = rows_of(layout, blocks, bs)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    got = kernel.paged_attention(q, k, v, tables, lens, bs, head_dim**-0.5, prefill)
    want = reference(q, dequantize_rows(k, dtype), dequantize_rows(v, dtype), tables, lens, bs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_cache_row_is_its_codes_and_scale(kernel: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k, v = (torch.randn(5, 2, 64).to(dtype) * 3 for _ in range(2))
    k[1, 0] = 0  # a row of zeros: scale 0, codes 0
    k_cache = torch.zeros(2, 64, 68, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 4, 60, 0])
    kernel.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[:, slots], quantize_rows(k.transpose(0, 1)))
    assert torch.equal(v_cache[:, slots], quantize_rows(v.transpose(0, 1)))
    back = dequantize_rows(k_cache[:, slots], torch.float32).transpose(0, 1)
    step = k.float().abs().amax(-1, keepdim=True) / 127  # each row within half a code
    assert bool(((back - k.float()).abs() <= step / 2 + 1e-6).all())
    assert not bool(back[1, 0].any())
    with pytest.raises(RuntimeError, match="do not fit the head dim"):
        kernel.write_kv(k, v, k_cache[..., :66].contiguous(), v_cache[..., :66].contiguous(), slots)


def test_the_torch_path_reads_an_int8_cache_as_the_kernel_does(kernel: Any) -> None:
    torch.manual_seed(0)
    bs, heads, kv_heads, dh = 16, 4, 2, 64
    k_cache = quantize_rows(torch.randn(1, kv_heads, 32 * bs, dh))
    v_cache = quantize_rows(torch.randn(1, kv_heads, 32 * bs, dh))
    items = [  # chunks and decodes reading cached keys (a fresh chunk's own keys: see below)
        ScheduledRequest("resumed", [1] * 12, 40, [7, 1, 12, 30], True),
        ScheduledRequest("decode", [1], 33, [5, 6, 20], True),
    ]
    q = torch.randn(13, heads, dh).to(torch.bfloat16)
    k, v = torch.randn(13, kv_heads, dh).to(torch.bfloat16), torch.randn(13, kv_heads, dh)
    v = v.to(torch.bfloat16)
    outs, caches = [], []
    for backend_kernel in (kernel, None):
        cache = k_cache.clone(), v_cache.clone()
        attention = PagedAttention(*cache, bs, backend_kernel, torch.bfloat16)
        attention.prepare(items, torch.device("cpu"))
        outs.append(attention(0, q, k, v).float())
        caches.append(cache)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.allclose(outs[0], outs[1], atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_and_decodes_attend_as_torch_attention_does(
    kernel: Any, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    bs, heads, kv_heads, dh = 16, 4, 2, 64
    k_cache = torch.randn(1, kv_heads, 32 * bs, dh).to(dtype)  # one layer, 32 blocks
    v_cache = torch.randn_like(k_cache)
    items = [  # a prompt's first chunk, a chunk resuming at 40, a decode at position 33
        ScheduledRequest("fresh", [1] * 20, 0, [3, 9], True),
        ScheduledRequest("resumed", [1] * 12, 40, [7, 1, 12, 30], True),
        ScheduledRequest("decode", [1], 33, [5, 6, 20], True),
    ]
    q = torch.randn(33, heads, dh).to(dtype)
    k, v = torch.randn(33, kv_heads, dh).to(dtype), torch.randn(33, kv_heads, dh).to(dtype)
    outs, caches = [], []
    for backend_kernel in (kernel, None):
        cache = k_cache.clone(), v_cache.clone()
        attention = PagedAttention(*cache, bs, backend_kernel)
        attention.prepare(items, torch.device("cpu"))
        outs.append(attention(0, q, k, v).float())
        caches.append(cache)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tolerance)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_the_engine_gives_the_same_tokens_with_and_without_it(
    kernel: Any, tiny: LoadedModel, chunk: int
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 160)), list(range(300, 333)), [9] * 20]

    def run(core: EngineCore) -> list[list[int]]:
        requests = [core.add_request(p, params) for p in prompts]
        while core.has_unfinished_requests():
            core.step()
        return [r.output_token_ids for r in requests]

    fast = make_core(tiny, max_num_batched_tokens=chunk)  # 16: chunks resume, beside decodes
    assert fast.runner.attention.kernel is not None  # type: ignore[attr-defined]
    with_kernels = run(fast)
    slow = make_core(tiny, max_num_batched_tokens=chunk)  # the same model: its kernels go too
    slow.runner.attention.kernel = None  # type: ignore[attr-defined]
    tiny.model.use_kernels(None)
    try:
        assert with_kernels == run(slow)
    finally:
        tiny.model.use_kernels(kernel)
