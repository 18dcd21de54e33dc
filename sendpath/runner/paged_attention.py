"""Attention over the paged KV cache, set up once per step for every layer.

The cache is two tensors of ``num_blocks * block_size`` token slots per layer and KV head
([L, Hkv, S, Dh]); a token at position p of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. On the CPU kernels every row
(a decode, or one token of a prompt chunk) reads its own context's blocks in place, up
to its own position (``model/kernels/paged_attention.cpp``); elsewhere torch's ops do
the same: each prefill chunk on its own (SDPA, causal over cache + chunk), and the
decodes' block tables gathered into one padded [B, Hkv, L, Dh] batch with a padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from sendpath.engine.scheduler import ScheduledRequest

__all__ = ["INT8_SCALE_BYTES", "PagedAttention", "dequantize_rows", "quantize_rows"]

INT8_SCALE_BYTES = 4  # an int8 cache row: head_dim codes, then their float32 scale


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] float rows -> [..., Dh + 4] int8 cache rows: round(x / scale) and the
    float32 scale, max |x| / 127 per row (what the CPU kernels' write_kv makes)."""
    top = x.float().abs().amax(-1, keepdim=True)
    scale = top / 127
    codes = (x.float() * torch.where(top > 0, 127 / top, 0.0)).round().clamp(-127, 127)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., Dh + 4] int8 cache rows -> [..., Dh] values in ``dtype``."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)


@dataclass
class _Prefill:
    rows: slice  # this chunk's rows in the flat batch
    slots: torch.Tensor  # [ctx] slots of the whole context (cache + chunk)
    mask: torch.Tensor | None  # [n, ctx] causal, additive (0 / -inf); None when it starts at 0


@dataclass
class _Decodes:
    rows: torch.Tensor  # [B] rows of the decode tokens in the flat batch
    blocks: torch.Tensor  # [B, nb] block tables, padded with block 0
    lens: torch.Tensor  # [B] context lengths (the new token included)
    mask: torch.Tensor  # [B, 1, 1, nb * block_size] True where a real context token is


class PagedAttention:
    """The ``AttentionBackend`` over the paged cache, set up once per step for all layers.

    Cache layout per layer: [Hkv, S, Dh] with S = num_blocks * block_size slots. With the
    CPU kernels, each row of the step gets its sequence's block table and its context
    length (its position + 1), and one kernel call a layer attends them all. Without
    them, gathering whole blocks for a batch of decodes yields [Hkv, B, L, Dh], whose
    transpose is the [B, Hkv, L, Dh] SDPA takes without another copy; decodes use
    grouped-query attention by folding each KV head's query heads into the query-length
    axis: [B, Hkv, group, Dh].
    """

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int,
        kernel: Any | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, Hkv, S, Dh] ([.., Dh + 4] int8)
        self.dtype = (
            k_cache.dtype if dtype is None else dtype
        )  # the queries' (an int8 cache's model's)
        self.block_size = block_size
        self.kernel = kernel  # kernels.cpu_kernels(), or None: index_copy_, gather and SDPA
        self.slot_mapping = torch.empty(0, dtype=torch.long)
        self.tables = torch.empty(0, 0, dtype=torch.long)  # [T, nb]: the kernel's, per row
        self.lens = torch.empty(0, dtype=torch.long)  # [T] each row's context length
        self.prefills: list[_Prefill] = []
        self.decodes: _Decodes | None = None

    def positions(self, item: ScheduledRequest) -> range:
        """The positions of an item's rows, in the step's row order. A decode with drafts
        goes last position first on the kernels: they attend consecutive positions of one
        sequence a tile at a time (``paged_attention.cpp``'s runs), and reversed, each of
        its rows is attended as a decode's row is, to the same numbers a plain decode
        step gets, so greedy output with speculation is the one without."""
        start, end = item.start_pos, item.start_pos + item.num_tokens
        if item.num_drafts and self.kernel is not None:
            return range(end - 1, start - 1, -1)
        return range(start, end)

    def prepare(self, items: list[ScheduledRequest], device: torch.device) -> None:
        """Build slot mappings, block tables and masks for a step (not per layer)."""
        bs = self.block_size
        slots = [
            item.block_ids[p // bs] * bs + p % bs for item in items for p in self.positions(item)
        ]
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        if self.kernel is not None:
            self._prepare_rows(items, device)
        else:
            self._prepare_torch(items, device)

    def _prepare_rows(self, items: list[ScheduledRequest], device: torch.device) -> None:
        """Each row's block table and context length, for the kernel."""
        ends = [item.start_pos + item.num_tokens for item in items]
        nb = max((-(-end // self.block_size) for end in ends), default=0)
        tables = [item.block_ids[:nb] + [0] * (nb - len(item.block_ids)) for item in items]
        self.tables = torch.tensor(tables, dtype=torch.long, device=device).view(len(items), nb)
        self.lens = torch.tensor(ends, dtype=torch.long, device=device)
        if any(item.num_tokens > 1 for item in items):  # a chunk's rows: one per position
            counts = torch.tensor([item.num_tokens for item in items], device=device)
            self.tables = self.tables.repeat_interleave(counts, dim=0)
            lens = [p + 1 for item in items for p in self.positions(item)]
            self.lens = torch.tensor(lens, device=device)

    def _prepare_torch(self, items: list[ScheduledRequest], device: torch.device) -> None:
        """Each prefill chunk's context slots and mask, and the decodes' padded tables."""
        bs = self.block_size
        self.prefills = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for item in items:
            start, end = item.start_pos, item.start_pos + item.num_tokens
            if item.num_tokens == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(item.block_ids[: -(-end // bs)])
                decode_lens.append(end)
            else:
                ctx = [item.block_ids[p // bs] * bs + p % bs for p in range(end)]
                mask = None
                if start > 0:
                    q_pos = torch.arange(start, end, device=device)[:, None]
                    later = torch.arange(end, device=device)[None, :] > q_pos
                    # additive, in the cache's dtype: SDPA would make this from a boolean
                    # mask in every layer
                    mask = torch.zeros(later.shape, dtype=self.dtype, device=device)
                    mask.masked_fill_(later, float("-inf"))
                slots = torch.tensor(ctx, dtype=torch.long, device=device)
                self.prefills.append(_Prefill(slice(row, row + item.num_tokens), slots, mask))
            row += item.num_tokens
        self.decodes = None
        if decode_rows:
            nb = max(len(t) for t in decode_tables)
            tables = [t + [0] * (nb - len(t)) for t in decode_tables]
            lens = torch.tensor(decode_lens, device=device)
            mask = torch.arange(nb * bs, device=device)[None, :] < lens[:, None]  # [B, L]
            self.decodes = _Decodes(
                rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
                blocks=torch.tensor(tables, dtype=torch.long, device=device),
                lens=lens,
                mask=mask[:, None, None, :],
            )

    def paged(self) -> tuple[Any, ...] | None:
        """On the kernels: the caches, slots, block tables, lengths and block size the C++
        layer stack reads the cache with, as ``__call__`` does per layer
        (``model/layer_stack.py``); else None."""
        if self.kernel is None:
            return None
        caches = self.k_cache, self.v_cache
        return *caches, self.slot_mapping, self.tables, self.lens, self.block_size

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # [Hkv, S, Dh]
        num_kv, dh = k.shape[1], k.shape[2]
        if self.kernel is not None:  # every row on its own context, read in place
            self.kernel.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
            return self.kernel.paged_attention(  # type: ignore[no-any-return]
                q, k_cache, v_cache, self.tables, self.lens, self.block_size, dh**-0.5
            )  # [T, H, Dh]
        int8 = k_cache.dtype == torch.int8
        store = quantize_rows if int8 else lambda x: x
        k_cache.index_copy_(1, self.slot_mapping, store(k.transpose(0, 1)))
        v_cache.index_copy_(1, self.slot_mapping, store(v.transpose(0, 1)))

        def load(rows: torch.Tensor) -> torch.Tensor:
            return dequantize_rows(rows, q.dtype) if int8 else rows

        group = q.shape[1] // num_kv
        d = self.decodes
        out = torch.empty_like(q)  # [T, H, Dh]
        for p in self.prefills:
            if p.mask is None:  # the chunk is the whole context: its own k/v, no gather
                keys, values = k[p.rows].transpose(0, 1), v[p.rows].transpose(0, 1)
            else:  # [H, ctx, Dh]: with a mask, SDPA's fused CUDA kernels take no groups
                # (enable_gqa sends it to the math path: a 1,024-token chunk after 4,096
                # cached tokens took 0.8 s in an 8B model's step on an H200, 30 ms alone)
                keys = load(k_cache[:, p.slots]).repeat_interleave(group, 0)
                values = load(v_cache[:, p.slots]).repeat_interleave(group, 0)
            o = F.scaled_dot_product_attention(  # 4-D: CPU's fused kernel wants a batch dim
                q[p.rows].transpose(0, 1)[None],  # [1, H, n, Dh]
                keys[None],
                values[None],
                attn_mask=p.mask,
                is_causal=p.mask is None,
                enable_gqa=p.mask is None,  # causal: each kv head serves its query heads
            )  # [1, H, n, Dh]
            out[p.rows] = o[0].transpose(0, 1)
        if d is not None:
            b, row = d.blocks.shape[0], k_cache.shape[-1]
            paged = (num_kv, -1, self.block_size, row)
            keys = load(k_cache.view(paged)[:, d.blocks]).view(num_kv, b, -1, dh).transpose(0, 1)
            values = load(v_cache.view(paged)[:, d.blocks]).view(num_kv, b, -1, dh).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q[d.rows].view(b, num_kv, group, dh),  # [B, Hkv, group, Dh]
                keys,  # [B, Hkv, L, Dh]
                values,
                attn_mask=d.mask,
            )  # [B, Hkv, group, Dh]
            out[d.rows] = o.reshape(b, num_kv * group, dh)
        return out
