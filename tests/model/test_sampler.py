"""The sampler: greedy is argmax, filters keep what they should, seeds reproduce."""

from __future__ import annotations

import torch

from sendpath.model.sampler import make_generator, sample
from sendpath.request import SamplingParams

CPU = torch.device("cpu")


def logits_rows() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, 1000) * 3


def test_greedy_is_argmax() -> None:
    logits = logits_rows()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_reduce_to_argmax() -> None:
    logits = logits_rows()
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)] * 2
    gens = [make_generator(i, CPU) for i in range(4)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = logits_rows()[:1]
    best = set(torch.topk(logits[0], 5).indices.tolist())
    gen = make_generator(1, CPU)
    draws = {
        sample(logits, [SamplingParams(top_k=5, temperature=5.0)], [gen])[0] for _ in range(200)
    }
    assert draws <= best and len(draws) > 1


def test_top_p_keeps_the_smallest_covering_set() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(3, CPU)
    draws = {sample(logits, [SamplingParams(top_p=0.8)], [gen])[0] for _ in range(300)}
    assert draws == {0, 1}


def test_seed_reproduces_and_rows_are_independent() -> None:
    logits = logits_rows()
    p = SamplingParams(temperature=1.0, seed=42)
    first = [sample(logits[:1], [p], [make_generator(42, CPU)])[0] for _ in range(3)]
    assert len(set(first)) == 1
    # the same seeded request gives the same token next to other rows
    batch = sample(
        logits[[0, 0, 0]],
        [p, SamplingParams(seed=7), p],
        [make_generator(42, CPU), make_generator(7, CPU), make_generator(42, CPU)],
    )
    assert batch[0] == batch[2] == first[0]
