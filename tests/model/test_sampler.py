"""The sampler: greedy is argmax, filters keep what they should, seeds reproduce, each
logit adjustment does what OpenAI and vLLM say, and logprobs are the model's own."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pytest import MonkeyPatch

from sendpath.model import sampler
from sendpath.model.sampler import History, TokenCounts, make_generator, sample
from sendpath.request import SamplingParams

CPU = torch.device("cpu")


def logits_rows() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, 1000) * 3


def tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator | None],
    histories: Sequence[History] | None = None,
) -> list[int | None]:
    return [s.token for s in sample(logits, params, gens, histories)]


def one(logits: torch.Tensor, params: SamplingParams, history: History) -> int | None:
    gen = None if params.greedy else make_generator(0, CPU)
    return tokens(logits[None], [params], [gen], [history])[0]


def test_greedy_is_argmax() -> None:
    logits = logits_rows()
    params = [SamplingParams(temperature=0.0)] * 4
    assert tokens(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_reduce_to_argmax() -> None:
    logits = logits_rows()
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)] * 2
    gens = [make_generator(i, CPU) for i in range(4)]
    assert tokens(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = logits_rows()[:1]
    best = set(torch.topk(logits[0], 5).indices.tolist())
    gen = make_generator(1, CPU)
    draws = {
        tokens(logits, [SamplingParams(top_k=5, temperature=5.0)], [gen])[0] for _ in range(200)
    }
    assert draws <= best and len(draws) > 1


def test_top_p_keeps_the_smallest_covering_set() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(3, CPU)
    draws = {tokens(logits, [SamplingParams(top_p=0.8)], [gen])[0] for _ in range(300)}
    assert draws == {0, 1}


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = make_generator(3, CPU)
    draws = {tokens(logits, [SamplingParams(min_p=0.5)], [gen])[0] for _ in range(300)}
    assert draws == {0, 1}  # 0.15 < 0.5 * 0.5


def test_seed_reproduces_and_rows_are_independent() -> None:
    logits = logits_rows()
    p = SamplingParams(temperature=1.0, seed=42)
    first = [tokens(logits[:1], [p], [make_generator(42, CPU)])[0] for _ in range(3)]
    assert len(set(first)) == 1
    # the same seeded request gives the same token next to other rows
    batch = tokens(
        logits[[0, 0, 0]],
        [p, SamplingParams(seed=7), p],
        [make_generator(42, CPU), make_generator(7, CPU), make_generator(42, CPU)],
    )
    assert batch[0] == batch[2] == first[0]


def test_a_seeded_top_p_row_draws_the_same_beside_rows_that_sort_further() -> None:
    logits = logits_rows()
    nucleus = SamplingParams(temperature=0.8, top_p=0.9)
    flat = SamplingParams(temperature=5.0, top_p=0.99)  # its 256 likeliest hold too little
    for seed in range(20):
        alone = tokens(logits[:1], [nucleus], [make_generator(seed, CPU)])[0]
        beside = tokens(
            logits[[1, 0, 2]],
            [flat, nucleus, SamplingParams(temperature=1.0)],
            [make_generator(99, CPU), make_generator(seed, CPU), None],
        )
        assert beside[1] == alone


def test_logit_bias_moves_greedy_choices_both_ways() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    empty = History([], [])
    assert one(logits, SamplingParams(temperature=0, logit_bias={3: 5.0}), empty) == 3
    assert one(logits, SamplingParams(temperature=0, logit_bias={0: -100.0}), empty) == 1


def test_min_tokens_holds_back_the_end_tokens() -> None:
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])  # token 1 is EOS, 2 a stop id
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=8)
    early = History([7], [3], end_ids=[1, 2])
    assert one(logits, params, early) == 3  # one output so far: neither end token yet
    assert one(logits, params, History([7], [3, 3], end_ids=[1, 2])) == 1


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.tensor([3.0, 2.5, 0.0])
    out = History([], [0, 0, 0])  # token 0 three times
    # presence: 3.0 - 1.0 = 2.0 < 2.5
    assert one(logits, SamplingParams(temperature=0, presence_penalty=1.0), out) == 1
    # frequency: 3.0 - 0.1 * 3 = 2.7 > 2.5, then 0.2 * 3 = 0.6 below it
    assert one(logits, SamplingParams(temperature=0, frequency_penalty=0.1), out) == 0
    assert one(logits, SamplingParams(temperature=0, frequency_penalty=0.2), out) == 1
    # penalties look at the output only, not the prompt
    in_prompt = History([0, 0, 0], [])
    assert one(logits, SamplingParams(temperature=0, presence_penalty=2.0), in_prompt) == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([3.0, 2.0, -1.0, -1.5])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert one(logits, params, History([0], [])) == 1  # 3.0 / 2 = 1.5 < 2.0 (prompt counts)
    neg = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: -10, 1: -10})
    assert one(logits, neg, History([], [2])) == 3  # -1 * 2 = -2 < -1.5


def test_logprobs_are_the_models_own_and_ranked() -> None:
    logits = logits_rows()
    params = SamplingParams(temperature=0, logprobs=5, logit_bias={7: 100.0})
    [got] = sample(logits[:1], [params], [None], [History([], [])])
    assert got.token == 7 and got.logprobs is not None
    logp = logits[0].log_softmax(-1)  # unbiased: the model's distribution
    assert math.isclose(got.logprobs.logprob, float(logp[7]), abs_tol=1e-5)
    top_ids = [t for t, _ in got.logprobs.top]
    assert top_ids == torch.topk(logp, 5).indices.tolist()
    values = [v for _, v in got.logprobs.top]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1.0


def test_draws_follow_each_rows_distribution_and_never_take_a_masked_token() -> None:
    # two rows drawn in one batch, each with its own distribution and generator; the
    # tokens at -inf (a vocabulary's tail, a masked id between others) are never drawn
    probs = [torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4, 0.0]), torch.tensor([0.0, 0.5, 0.5, 0, 0, 0])]
    logits = torch.stack([p.log() for p in probs])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    gens = [make_generator(1, CPU), make_generator(2, CPU)]
    counts = torch.zeros(2, 6)
    for _ in range(4000):
        for row, token in enumerate(tokens(logits, params, gens)):
            assert token is not None
            counts[row, token] += 1
    assert counts[0, 2] == counts[0, 5] == 0 and counts[1, [0, 3, 4, 5]].sum() == 0
    shares = counts / 4000
    for row, expected in enumerate(probs):
        assert torch.allclose(shares[row], expected, atol=0.025), (row, shares[row])


def full_sort_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row filtered as vLLM does it: temperature, top-k, top-p by a sort of the whole
    row (drop the least likely tokens while they hold at most 1 - top_p), min-p."""
    row = row / p.temperature
    if p.top_k is not None:
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        ascending, order = torch.sort(row)
        drop = ascending.softmax(-1).cumsum(-1) <= 1.0 - p.top_p
        drop[-1] = False
        row = row.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


def test_draws_follow_what_a_full_sort_of_each_row_keeps(monkeypatch: MonkeyPatch) -> None:
    # top-p looks at a row's 2, then 8 likeliest tokens before it sorts the whole row, and
    # draws among those it looked at: a peaked row settles among 2, a middling one among
    # 8, a flat one needs the sort. In one batch, rows with their own top-k, top-p and
    # min-p draw each token as often as a full sort's filter gives it, never one it drops
    monkeypatch.setattr(sampler, "NUCLEUS_TRIES", (2, 8))
    torch.manual_seed(0)
    logits = torch.randn(7, 40) * torch.tensor([6.0, 2.0, 0.2, 2.0, 1.0, 1.5, 1.0])[:, None]
    mass = logits[:3].softmax(-1).sort(descending=True).values.cumsum(-1)
    assert mass[0, 1] >= 0.9 > mass[1, 1] and mass[1, 7] >= 0.9 > mass[2, 7]
    nucleus = SamplingParams(top_p=0.9)
    params = [nucleus, nucleus, nucleus, SamplingParams(temperature=0.7, top_k=10, top_p=0.8),
              SamplingParams(min_p=0.3, top_p=0.95),
              SamplingParams(temperature=2.0, top_p=0.3, min_p=0.1),
              SamplingParams(min_p=0.2)]  # fmt: skip
    gens = [make_generator(i, CPU) for i in range(7)]
    counts = torch.zeros(7, 40)
    for _ in range(4000):
        for row, token in enumerate(tokens(logits, params, gens)):
            assert token is not None
            counts[row, token] += 1
    for row, p in enumerate(params):
        expected = full_sort_filter(logits[row], p).softmax(-1)
        assert counts[row][expected == 0].sum() == 0, p
        # within 5 standard deviations of each token's count (fixed seeds: no luck involved)
        spread = 5 * (expected * (1 - expected) / 4000).sqrt() + 1 / 4000
        assert ((counts[row] / 4000 - expected).abs() <= spread).all(), p


def test_token_counts_kept_across_steps_match_counts_made_afresh() -> None:
    # a request's counts brought up to date a token at a time, and told of an output that
    # is not the one counted (shorter), hold what counts made from scratch hold; ids out
    # of the vocabulary are not counted
    prompt, output = [5, 7, 7, 999_999], [3, 5, 3, -1, 9, 3]
    kept = TokenCounts(prompt)
    for n in (0, 1, 2, 6, 3, 5, 6):
        afresh = TokenCounts(prompt).update(output[:n], 12)
        assert kept.update(output[:n], 12) is kept and kept.counted == n
        in_output = [t for t in output[:n] if 0 <= t < 12]
        for counts in (kept, afresh):
            assert sorted(counts.seen_ids.tolist()) == sorted({5, 7, *in_output})
            assert sorted(counts.output_ids.tolist()) == sorted(set(in_output))
            expected = torch.bincount(torch.tensor(in_output, dtype=torch.long), minlength=12)
            assert counts.output_counts.tolist() == expected.tolist()
