"""Pick the next token of each row from its logits, each row with its own parameters and RNG.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p
(the smallest set of tokens whose probability reaches ``top_p``, as vLLM does), then draw
from a ``torch.Generator`` that belongs to the request, so a seeded request gives the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from sendpath.request import SamplingParams

__all__ = ["make_generator", "sample"]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's own RNG: seeded when asked, otherwise from fresh entropy."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> temperature-scaled logits [V] with filtered-out tokens at -inf."""
    logits = logits / params.temperature
    if params.top_k is not None and 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1.0 - params.top_p
        drop[-1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """logits [N, V] float32 -> one token id per row (``None``: the row cannot be sampled)."""
    out: list[int | None] = [int(t) for t in logits.argmax(dim=-1).tolist()]
    nan_rows = torch.isnan(logits.sum(dim=-1))  # any NaN makes the sum NaN (one pass)
    if bool(nan_rows.any()):
        for i in nan_rows.nonzero().flatten().tolist():
            out[i] = None
    for i, p in enumerate(params):
        if p.greedy or out[i] is None:
            continue
        try:
            probs = _filter(logits[i], p).softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        except RuntimeError:  # "probability tensor contains either inf, nan or element < 0"
            out[i] = None
    return out
