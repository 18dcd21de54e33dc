"""Run one sequence at a time over a contiguous KV cache: prefill, then decode token by token.

The simplest correct way to generate, kept as the reference that batched execution must
match token for token: the model and engine tests run it beside the paged engine (the
offline ``LLM`` API runs the engine, as the servers do).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from sendpath.engine.outputs import OutputStream
from sendpath.model.llama import LlamaConfig
from sendpath.model.loader import LoadedModel
from sendpath.model.sampler import History, TokenCounts, make_generator, sample
from sendpath.model.structured import grammar_compiler
from sendpath.request import SamplingParams

__all__ = ["ContiguousKVCache", "GeneratedToken", "SequenceRunner"]


class ContiguousKVCache:
    """An ``AttentionBackend`` for one sequence: K/V in [layers, max_len, Hkv, Dh] buffers.

    A forward pass writes its T new tokens at ``length .. length+T``; the caller moves
    ``length`` forward with ``advance(T)`` once every layer has run.
    """

    def __init__(
        self, config: LlamaConfig, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        t, start = q.shape[0], self.length
        end = start + t
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        group = q.shape[1] // k.shape[1]
        # Heads repeated by hand: CPU SDPA's fused kernel does not take enable_gqa and
        # falls back to a slower unfused path with it.
        keys = self.k[layer, :end].transpose(0, 1).repeat_interleave(group, 0)  # [H, end, Dh]
        values = self.v[layer, :end].transpose(0, 1).repeat_interleave(group, 0)  # [H, end, Dh]
        mask = None
        if t > 1 and start > 0:  # new tokens see the whole past and the causal part of now
            rows = torch.arange(start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= rows  # [T, end]
        out = F.scaled_dot_product_attention(  # 4-D inputs: CPU's fused kernel wants a batch dim
            q.transpose(0, 1)[None],  # [1, H, T, Dh]
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=t > 1 and start == 0,
        )  # [1, H, T, Dh]
        return out[0].transpose(0, 1)  # [T, H, Dh]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


@dataclass
class GeneratedToken:
    """One decode step's result for the caller: the id, the new text, and done-or-not."""

    token_id: int
    text: str
    finished: bool


class SequenceRunner:
    """Generates for one prompt at a time on a loaded model."""

    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.max_model_len = max_model_len or loaded.max_model_len

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [P, V] of every prompt position (for parity checks against a reference)."""
        cache = self._cache(len(prompt_ids))
        hidden = self._forward(cache, prompt_ids)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, stream: OutputStream
    ) -> Iterator[GeneratedToken]:
        """Prefill the prompt, then decode until ``stream`` says the request is finished."""
        gen = None if params.greedy else make_generator(params.seed, self.model.device)
        cache = self._cache(min(self.max_model_len, len(prompt_ids) + params.max_tokens))
        hidden = self._forward(cache, prompt_ids)[-1:]
        ends = [] if params.ignore_eos else list(self.loaded.tokenizer.eos_token_ids)
        ends += params.stop_token_ids
        history = History(prompt_ids, stream.token_ids, ends, TokenCounts(prompt_ids))
        matcher = None
        if params.structured is not None:
            matcher = grammar_compiler(self.loaded.tokenizer).matcher(params.structured)
        while True:
            logits = self.model.compute_logits(hidden)
            allowed = [None if matcher is None else matcher.allowed(logits.shape[-1])]
            token = sample(logits, [params], [gen], [history], allowed)[0].token
            if matcher is not None and token is not None:
                matcher.consume(token)
            if token is None:
                raise RuntimeError("the model's logits cannot be sampled (NaN)")
            text = stream.append(token)
            yield GeneratedToken(token, text, stream.finished)
            if stream.finished:
                return
            hidden = self._forward(cache, [token])

    def _cache(self, max_len: int) -> ContiguousKVCache:
        return ContiguousKVCache(self.model.config, max_len, self.model.dtype, self.model.device)

    def _forward(self, cache: ContiguousKVCache, ids: list[int]) -> torch.Tensor:
        device = self.model.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        positions = torch.arange(cache.length, cache.length + len(ids), device=device)
        hidden = self.model(input_ids, positions, cache)
        cache.advance(len(ids))
        return hidden  # type: ignore[no-any-return]
