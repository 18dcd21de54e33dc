"""A Llama-family decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The architectures that differ from Llama by a detail are switches on ``LlamaConfig``, as
vLLM and nano-vllm keep them: Qwen2 / Qwen2.5 add biases to the q/k/v projections
(``qkv_bias``), Qwen3 normalises each head of q and k before RoPE (``qk_norm``), Mistral
may attend over a sliding window (``sliding_window``: the loader caps the context there,
so every answer stays exact).

The model works on a flat batch of T tokens (several sequences side by side, as a
continuous-batching engine feeds it) and never owns a KV cache: every attention layer hands
its q/k/v to an ``AttentionBackend``, which writes k/v where the cache lives (a contiguous
buffer for one sequence, a paged pool for many) and returns the attention output.

The residual stream is carried beside each layer's output, as vLLM's models carry it, so
that "add the residual, then normalise" is one step (``RMSNorm.add_and_norm``). Every small
operation around the matmuls has a plain torch form here; ``LlamaModel.use_kernels`` swaps
in fused CPU kernels for them (``sendpath/model/kernels``: the same numbers, computed in
float32 and rounded once, in one call where torch takes several).

Shapes use T = tokens in this step, D = hidden size, H / Hkv = query / key-value heads,
Dh = head dim, F = MLP width, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from sendpath.model.linear import Linear
from sendpath.model.rope import RopeScaling, rope_inv_freq, rotate_half

__all__ = ["AttentionBackend", "LayerKernels", "LlamaConfig", "LlamaModel"]


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture numbers of a Llama-family model (what config.json / GGUF say)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"  # llama, mistral, qwen2, qwen3: what the switches below say
    qkv_bias: bool = False  # Qwen2: q/k/v projections with biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    sliding_window: int | None = None  # Mistral: attention over the last N tokens

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * dh * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (self.num_heads + 2 * self.num_kv_heads) * dh if self.qkv_bias else 0
        attn += 2 * dh if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head


class AttentionBackend(Protocol):
    """Where the KV cache lives. Called once per layer per forward pass.

    Must store ``k``/``v`` (the new tokens' keys and values) in layer ``layer``'s cache and
    return causal attention of ``q`` over everything cached so far for each token's sequence.
    q: [T, H, Dh]; k, v: [T, Hkv, Dh]; returns [T, H, Dh]. A backend may also have
    ``paged()``: the paged cache and the step's slots, and each row's block table and context
    length, which the C++ layer stack then reads in place (else None).
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class LayerKernels(Protocol):
    """Fused forms of a layer's small operations (``kernels/fused_ops.cpp``)."""

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: residual += x, then x = rms_norm(residual) * weight."""

    def rotary_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int
    ) -> None:
        """In place: RoPE on the first ``heads`` heads of each row of ``qkv``."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up]."""


class RMSNorm(nn.Module):
    """x / rms(x) * weight in one fused op (torch computes bfloat16 and float16 inputs'
    statistics in float32, and the product before rounding)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: LayerKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight=self.weight, eps=self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the kernel reuses both tensors' memory."""
        if self.kernels is not None and x.is_contiguous() and residual.is_contiguous():
            self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.kernels: LayerKernels | None = None
        self.qkv_bias: nn.Parameter | None = None  # Qwen2
        if config.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size))
        self.q_norm: RMSNorm | None = None  # Qwen3: one weight [Dh] for every head
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def _normed_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each head of q and k through its RMSNorm (Qwen3), v as it was."""
        assert self.q_norm is not None and self.k_norm is not None
        t, dh = qkv.shape[0], self.head_dim
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, dh)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, dh)).reshape(t, self.kv_size)
        return torch.cat([q, k, v], dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, H*Dh + 2*Hkv*Dh]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            qkv = self._normed_heads(qkv)
        heads = self.num_heads + self.num_kv_heads  # RoPE on queries and keys at once
        if self.kernels is not None and qkv.is_contiguous():
            self.kernels.rotary_(qkv, cos, sin, heads, self.head_dim)
            q, k, v = qkv.view(t, -1, self.head_dim).split(
                [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1
            )  # [T, H|Hkv|Hkv, Dh]
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(t, heads, self.head_dim)  # [T, H + Hkv, Dh]
            qk = qk * cos + rotate_half(qk, sin)  # cos/sin: [T, 1, Dh]
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H|Hkv, Dh]
            v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        out = attn(self.layer, q, k, v)  # [T, H, Dh]
        y: torch.Tensor = self.o_proj(out.reshape(t, self.q_size))  # [T, D]
        return y


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self.kernels: LayerKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2F]
        if self.kernels is not None and gate_up.is_contiguous():
            hidden = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, F] each
            hidden = F.silu(gate) * up
        y: torch.Tensor = self.down_proj(hidden)  # [T, D]
        return y


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = s + attn(norm(s)), then h + mlp(norm(h)), for the
    residual stream s. It takes and returns (output, stream before the output is added):
    the add happens in the next norm."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: x is the embeddings, the stream itself
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Token ids + positions -> final hidden states; ``compute_logits`` maps them to the vocab."""

    inv_freq: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # given its (empty) weight, the embedding skips its random init: every caller loads
        # or draws the weights after, and that init under ``torch.device("meta")`` imports
        # torch._dynamo (3 s of a process's start)
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models get a copy of the embeddings here (+V*D memory, so the head can take
        # the faster layout); ``num_params`` still counts them once.
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
            persistent=False,
        )
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stack: Any | None = None  # every layer in one C++ call (``layer_stack.py``)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, Dh] for the given absolute positions [T], sin's first half
        negated (what ``rotate_half`` takes)."""
        if self._rope_cache is None or self._rope_cache[0].dtype != dtype:
            # the same float32 maths per position, done once for the whole context
            pos = torch.arange(self.config.max_position_embeddings, device=self.inv_freq.device)
            freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [P, Dh/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
            sin = emb.sin()
            half = sin.shape[-1] // 2
            signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._rope_cache = emb.cos().to(dtype), signed.to(dtype)
        cos, sin = self._rope_cache
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, D] after the final norm."""
        x = self.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rope(positions, x.dtype)
        if self.stack is not None:  # the same kernels in the same order, in one call
            paged = getattr(attn, "paged", None)
            out: torch.Tensor = self.stack.forward(
                x, self.norm.weight, cos, sin, attn, paged() if paged else None
            )
            return out
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        if residual is None:  # no layers
            return self.norm(x)  # type: ignore[no-any-return]
        return self.norm.add_and_norm(x, residual)[0]

    def use_kernels(self, kernels: LayerKernels | None) -> None:
        """Run the small operations around the matmuls with these fused kernels (None:
        torch's own ops again). A layer stack made for the old kernels is dropped:
        ``layer_stack.use_kernels`` makes one for these, where the layers allow it."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.kernels = kernels
        self.stack = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in float32."""
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype
