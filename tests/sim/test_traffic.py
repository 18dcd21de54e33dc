"""The simulated traffic's prompts: the lengths asked for, random ids in the vocabulary,
the same for the same seed, and no two alike beyond the shared prefix."""

from __future__ import annotations

from sendpath.bench.workload import LengthSpec
from sendpath.kvcache.hashing import block_hashes
from sendpath.sim.traffic import HEAD, MATERIAL, VOCAB, Traffic


def test_prompts_have_the_asked_lengths_and_ids_in_the_vocabulary() -> None:
    for n in (1, HEAD, HEAD + 1, MATERIAL + HEAD, MATERIAL + HEAD + 1):
        fixed = Traffic(rate=5, num_requests=3, input_len=LengthSpec(n, n)).first_turns()
        assert [len(r.prompt) for r in fixed] == [n] * 3
    lengths = LengthSpec(1, MATERIAL + 2 * HEAD)  # shorter than HEAD to longer than the text
    first = Traffic(rate=5, num_requests=300, input_len=lengths, seed=3).first_turns()
    assert [len(r.prompt) for r in first] != [len(first[0].prompt)] * len(first)
    for r in first:
        assert all(VOCAB[0] <= t < VOCAB[1] for t in r.prompt)
    again = Traffic(rate=5, num_requests=300, input_len=lengths, seed=3).first_turns()
    assert [r.prompt for r in again] == [r.prompt for r in first]
    other = Traffic(rate=5, num_requests=300, input_len=lengths, seed=4).first_turns()
    assert [r.prompt for r in other] != [r.prompt for r in first]


def test_no_two_prompts_share_a_block_beyond_the_shared_prefix() -> None:
    """What the prefix cache and a prefix-aware router see: the system prompt shared,
    then every prompt on its own from its next block on."""
    traffic = Traffic(rate=50, num_requests=5000, input_len=LengthSpec(64, 700),
                      shared_prefix=32, turns=2)  # fmt: skip
    prompts = [r.prompt for r in traffic.first_turns()]
    prompts += [q for r in traffic.first_turns() for q, _ in r.followups]
    assert len({tuple(p[:32]) for p in prompts[: len(prompts) // 2]}) == 1
    after = [p[32:48] for p in prompts[: len(prompts) // 2]]  # each first turn's own block
    assert len({tuple(b) for b in after}) == len(after)
    firsts = {block_hashes(p, 16)[0] for p in prompts[len(prompts) // 2 :]}  # the questions
    assert len(firsts) == len(prompts) // 2
