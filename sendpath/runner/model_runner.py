"""The model runner: one mixed step (prefill chunks + decodes) as one batched forward pass.

The KV cache is two tensors of ``num_blocks * block_size`` token slots per layer and KV
head ([L, Hkv, S, Dh]); a token at position p of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. Each step:

1. flattens every scheduled request's new tokens into one [T] batch with positions and slots;
2. runs the model once; each layer writes the new K/V to their slots, then attends. On
   the CPU every row reads its own context's blocks in place (``PagedAttention``,
   ``runner/paged_attention.py``), and the model's small operations run fused
   (``model/kernels/fused_ops.cpp``); elsewhere, or where those kernels cannot be built,
   torch's ops do the same;
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
from typing import Any

import torch

from sendpath.config import CacheConfig
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
from sendpath.runner.huge_pages import zeros_on_huge_pages
from sendpath.runner.paged_attention import INT8_SCALE_BYTES, PagedAttention

__all__ = [
    "ModelRunner",
    "cache_blocks",
    "describe_device",
    "kv_bytes_per_token",
    "kv_cache_dtype",
]


UNSAMPLED = "its logits could not be sampled (NaN, or every token masked out)"


def kv_cache_dtype(asked: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for ``--kv-cache-dtype``: auto is the model's; int8 keeps codes and
    a float32 scale per token and kv head; bfloat16 and float32 must be the model's (the
    attention reads the cache in the queries' dtype). ``ValueError`` where it cannot be."""
    if asked == "auto":
        return model_dtype
    if asked == "int8":
        return torch.int8
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(asked)
    if dtype is None:
        raise ValueError(
            f"kv cache dtype {asked!r} is not offered; use auto, bfloat16, float32 or int8"
        )
    if dtype != model_dtype:
        name = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"a {asked} KV cache needs a {asked} model, and this one runs in {name}: "
            f"pass --dtype {asked}, or --kv-cache-dtype auto or int8"
        )
    return dtype


def kv_row_size(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Values in one token's cache row for one kv head: the head dim, and for an int8 cache
    the four bytes of its scale (``kernels.h``'s kInt8ScaleBytes)."""
    return config.head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def kv_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V for one token across all layers, in a cache of ``dtype``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * kv_row_size(config, dtype) * itemsize


def cache_blocks(cache: CacheConfig, config: LlamaConfig, dtype: torch.dtype) -> int:
    """The KV cache's blocks: ``cache.num_blocks``, or as many as its memory holds in a
    cache of ``dtype``."""
    per_block = kv_bytes_per_token(config, dtype) * cache.block_size
    return cache.num_blocks or int(cache.kv_cache_memory_gib * 2**30 // per_block)


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
            "attention": self.attention_kind,
            "kv_cache_dtype": str(self.k_cache.dtype).removeprefix("torch."),
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

    def _attention_kind(self, loaded: LoadedModel) -> str:
        """The attention backend, and what takes a prompt chunk's rows (AMX's tiles where
        they run: ``kernels/paged_prefill_amx.h``; with float32 activations the float32
        tile, ``kernels/paged_prefill_f32.cpp``)."""
        kernel = self.attention.kernel
        if kernel is None:
            return "torch SDPA"
        dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(self.model.dtype)
        if dtype is None:
            return "paged kernel"
        cfg = loaded.config
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.block_size)
        prefill = kernel.prefill_kernel(*shape, dtype)
        how = {
            "amx": "on AMX bfloat16 tiles",
            "vector": "on AVX-512 BF16 tiles" if dtype == "bfloat16" else "on float32 vector tiles",
            "rows": "a row at a time",
        }
        return f"paged kernel, prompt chunks {how[prefill]}"

    def _layer_ops(self) -> str:
        if self.model.stack is not None:
            return "fused kernels, every layer in one call"
        return "fused kernels" if self.attention.kernel else "torch ops"

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = loaded.model
        self.precision = loaded.precision
        self.block_size = block_size
        cfg = loaded.config
        dtype, device = self.model.dtype, self.model.device
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        row = kv_row_size(cfg, cache_dtype)
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks * block_size, row)
        self.k_cache = zeros_on_huge_pages(shape, cache_dtype, device)
        self.v_cache = zeros_on_huge_pages(shape, cache_dtype, device)
        kernels = None
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            kernels = cpu_kernels()
        use_kernels(self.model, kernels)
        self.attention = PagedAttention(self.k_cache, self.v_cache, block_size, kernels, dtype)
        self.matrix_engine = self._matrix_engine()
        self.attention_kind = self._attention_kind(loaded)
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
