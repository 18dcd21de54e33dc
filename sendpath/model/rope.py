"""Rotary position embeddings: the per-pair frequencies (with linear, Llama 3 or per-pair
divisor scaling) and the rotate-half trick the model applies them with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RopeScaling", "rope_inv_freq", "rotate_half"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear``, Llama 3's ``llama3`` (per-band rescaling), or
    ``factors``: a divisor per frequency (``freq_factors``, what llama3 works out to; GGUF
    files carry it as a ``rope_freqs`` tensor)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [Dh/2] for ``theta`` and ``scaling`` (float32), on the
    CPU whatever the default device (under ``torch.device("meta")`` the arithmetic would
    run meta kernels, whose first use imports torch._dynamo: 3 s of a process's start)."""
    dh = head_dim
    steps = torch.arange(0, dh, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (theta ** (steps.float() / dh))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "factors" and scaling.freq_factors is not None:
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32, device="cpu")
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half(x) * sin, where rotate_half maps halves (a, b) to (-b, a): the roll
    (b, a) times ``sin`` with its first half negated (``LlamaModel.rope``), in 2 ops not 5,
    and the same numbers (a negation is exact)."""
    return x.roll(x.shape[-1] // 2, dims=-1) * sin
