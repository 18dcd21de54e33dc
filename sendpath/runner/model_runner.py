"""The model runner: one mixed step (prefill chunks + decodes) as one batched forward pass.

The KV cache is two tensors of ``num_blocks * block_size`` token slots per layer and KV
head ([L, Hkv, S, Dh]); a token at position p of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. Each step:

1. flattens every scheduled request's new tokens into one [T] batch with positions and slots;
2. runs the model once; each layer writes the new K/V to their slots, then attends. On
   the CPU every row (a decode, or one token of a prompt chunk) reads its own context's
   blocks in place, up to its own position (``model/kernels/paged_attention.cpp``), and
   the model's small operations run fused (``model/kernels/fused_ops.cpp``). Elsewhere, or
   where those kernels cannot be built, torch's ops do the same: each prefill chunk on its
   own (SDPA, causal over cache + chunk), and the decodes' block tables gathered into one
   padded [B, Hkv, L, Dh] batch with a padding mask;
3. computes logits only for requests whose plan says ``sample``, and samples each with its
   own parameters and generator; a row that cannot be sampled is reported in ``failed``.
   A decode with draft tokens (speculative decoding) samples every one of its rows, and
   keeps the drafts up to the first the model did not produce (``engine/speculative.py``).

``probe()`` runs one token through the model without touching the cache: the engine asks
it, when a step fails for every request in it, whether the device itself still computes.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from sendpath.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from sendpath.engine.speculative import accept
from sendpath.model.kernels import cpu_kernels
from sendpath.model.layer_stack import use_kernels
from sendpath.model.llama import LlamaConfig
from sendpath.model.loader import LoadedModel
from sendpath.model.quant import BlockWeights, matrix_engine
from sendpath.model.sampler import History, Sampled, TokenCounts, make_generator, sample
from sendpath.model.structured import Matcher, grammar_compiler
from sendpath.request import Request

__all__ = ["ModelRunner", "PagedAttention", "describe_device", "kv_bytes_per_token"]


UNSAMPLED = "its logits could not be sampled (NaN, or every token masked out)"


def kv_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token across all layers."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


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
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, Hkv, S, Dh]
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
                    mask = torch.zeros(later.shape, dtype=self.k_cache.dtype, device=device)
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
        k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        group = q.shape[1] // num_kv
        d = self.decodes
        out = torch.empty_like(q)  # [T, H, Dh]
        for p in self.prefills:
            if p.mask is None:  # the chunk is the whole context: its own k/v, no gather
                keys, values = k[p.rows].transpose(0, 1), v[p.rows].transpose(0, 1)
            else:
                keys, values = k_cache[:, p.slots], v_cache[:, p.slots]  # [Hkv, ctx, Dh]
            o = F.scaled_dot_product_attention(  # 4-D: CPU's fused kernel wants a batch dim
                q[p.rows].transpose(0, 1)[None],  # [1, H, n, Dh]
                keys[None],
                values[None],
                attn_mask=p.mask,
                is_causal=p.mask is None,
                enable_gqa=True,  # each kv head serves its group of query heads, no copies
            )  # [1, H, n, Dh]
            out[p.rows] = o[0].transpose(0, 1)
        if d is not None:
            b = d.blocks.shape[0]
            paged = (num_kv, -1, self.block_size, dh)
            keys = k_cache.view(paged)[:, d.blocks].view(num_kv, b, -1, dh).transpose(0, 1)
            values = v_cache.view(paged)[:, d.blocks].view(num_kv, b, -1, dh).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q[d.rows].view(b, num_kv, group, dh),  # [B, Hkv, group, Dh]
                keys,  # [B, Hkv, L, Dh]
                values,
                attn_mask=d.mask,
            )  # [B, Hkv, group, Dh]
            out[d.rows] = o.reshape(b, num_kv * group, dh)
        return out


def describe_device(device: torch.device) -> str:
    """The device in words: ``cuda (NVIDIA H200)``, ``cpu (x86_64, 2 cores)``."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"{device.type} ({platform.machine()}, {os.cpu_count()} cores)"


class ModelRunner:
    """Owns the KV cache tensors and each request's sampling state."""

    def describe(self) -> dict[str, Any]:
        """What runs the steps: device, dtype, torch version and threads."""
        return {
            "device": describe_device(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "quantization": self.precision.quantization,
            "attention": "paged kernel" if self.attention.kernel else "torch SDPA",
            "layer_ops": self._layer_ops(),
            "precision_reason": self.precision.reason,
            "matrix_engine": self.matrix_engine,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        }

    def _matrix_engine(self) -> str:
        """The CPU's matrix engine as the block-quantized weights use it (``none`` on a GPU,
        or where the weights are not block-quantized); once, at load (``describe`` answers
        every ``/load``)."""
        if self.model.device.type != "cpu":
            return f"none: {self.model.device.type}"
        blocks = any(
            isinstance(getattr(m, "quantized", None), BlockWeights) for m in self.model.modules()
        )
        if not blocks:
            return "none: no block-quantized weights"
        return matrix_engine(cpu_kernels())

    def _layer_ops(self) -> str:
        if self.model.stack is not None:
            return "fused kernels, every layer in one call"
        return "fused kernels" if self.attention.kernel else "torch ops"

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        self.model = loaded.model
        self.precision = loaded.precision
        self.block_size = block_size
        cfg = loaded.config
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        dtype, device = self.model.dtype, self.model.device
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        kernels = None
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            kernels = cpu_kernels()
        use_kernels(self.model, kernels)
        self.attention = PagedAttention(self.k_cache, self.v_cache, block_size, kernels)
        self.matrix_engine = self._matrix_engine()
        self.tokenizer = loaded.tokenizer
        self.end_ids = list(loaded.tokenizer.eos_token_ids)  # what min_tokens holds back
        self._requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._matchers: dict[str, Matcher] = {}  # structured output: each one's grammar
        self._counts: dict[str, TokenCounts] = {}  # penalties: each one's tokens so far

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if params.structured is not None:  # the engine checked the schema on arrival
            compiler = grammar_compiler(self.tokenizer)
            self._matchers[request.request_id] = compiler.matcher(params.structured)
        if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            self._counts[request.request_id] = TokenCounts(request.prompt_token_ids)
        self._requests[request.request_id] = request
        self._generators[request.request_id] = (
            None if params.greedy else make_generator(params.seed, self.model.device)
        )

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._counts.pop(request_id, None)

    def _history(self, request: Request) -> History:
        params = request.sampling_params
        ends = [] if params.ignore_eos else self.end_ids
        return History(
            request.prompt_token_ids,
            request.output_token_ids,
            [*ends, *params.stop_token_ids],
            self._counts.get(request.request_id),
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step; sample for the requests whose plan says so."""
        if plan.is_empty:
            return RunnerOutput()
        device = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        owners: list[ScheduledRequest] = []  # the request of each sampled row
        for item in plan.requests:
            base, rows = len(ids), self.attention.positions(item)
            if rows.step > 0:
                ids += item.token_ids
            else:  # a decode with drafts, last position first
                ids += item.token_ids[::-1]
            positions += rows
            if item.sample:  # its last row; a decode with drafts: its every row
                firsts = range(item.num_tokens - 1 - item.num_drafts, item.num_tokens)
                top = base + item.num_tokens - 1
                sample_rows += [base + i if rows.step > 0 else top - i for i in firsts]
                owners += [item] * (1 + item.num_drafts)
        self.attention.prepare(plan.requests, device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.attention,
        )  # [T, D]
        if not owners:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
        requests = [self._requests[i.request_id] for i in owners]
        matchers = [self._matchers.get(i.request_id) for i in owners]
        results = sample(
            logits,
            [r.sampling_params for r in requests],
            [self._generators[i.request_id] for i in owners],
            [self._history(r) for r in requests],
            [None if m is None else m.allowed(logits.shape[-1]) for m in matchers],
        )
        out = RunnerOutput()
        row = 0
        for item in (i for i in plan.requests if i.sample):
            if item.num_drafts:
                self._verify(item, results[row : row + 1 + item.num_drafts], out)
            else:
                self._sampled(item, results[row], matchers[row], out)
            row += 1 + item.num_drafts
        return out

    @staticmethod
    def _sampled(
        item: ScheduledRequest, result: Sampled, matcher: Matcher | None, out: RunnerOutput
    ) -> None:
        if result.token is None:
            out.failed[item.request_id] = UNSAMPLED
            return
        if matcher is not None:
            matcher.consume(result.token)
        out.sampled[item.request_id] = result.token
        if result.logprobs is not None:
            out.logprobs[item.request_id] = result.logprobs

    @staticmethod
    def _verify(item: ScheduledRequest, rows: list[Sampled], out: RunnerOutput) -> None:
        """A decode's drafts against the tokens its rows sampled: the kept ones in
        ``accepted``, the token after them in ``sampled``."""
        tokens = [r.token for r in rows]
        if any(t is None for t in tokens):
            out.failed[item.request_id] = UNSAMPLED
            return
        drafts = item.token_ids[-item.num_drafts :]
        kept, token = accept(drafts, tokens)  # type: ignore[arg-type]  # no None left
        out.accepted[item.request_id] = kept
        out.sampled[item.request_id] = token

    @torch.inference_mode()
    def probe(self) -> None:
        """One token through every layer and the logits, no KV cache: raises if the device
        cannot compute (gone, out of memory), returns if it can."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return v.repeat_interleave(q.shape[1] // v.shape[1], 1)  # [1, H, Dh]: one token

        device = self.model.device
        zero = torch.zeros(1, dtype=torch.long, device=device)
        logits = self.model.compute_logits(self.model(zero, zero, attend))
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("the model computes non-finite logits for a plain token")
