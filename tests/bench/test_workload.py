"""Datasets: lengths, determinism, multi-turn history."""

from __future__ import annotations

import random

import pytest

from sendpath.bench.workload import LengthSpec, build


def test_length_spec() -> None:
    assert LengthSpec.parse("128") == LengthSpec(128, 128)
    spec = LengthSpec.parse("64-256")
    rng = random.Random(0)
    assert all(64 <= spec.sample(rng) <= 256 for _ in range(100)) and spec.mean == 160
    for bad in ("0", "x", "10-5", "-3"):
        with pytest.raises(ValueError, match="length"):
            LengthSpec.parse(bad)


def test_random_and_long_document() -> None:
    a = build("random", 5, LengthSpec(10, 10), LengthSpec(7, 7), seed=1)
    b = build("random", 5, LengthSpec(10, 10), LengthSpec(7, 7), seed=1)
    assert [c.turns for c in a] == [c.turns for c in b]  # the same for the same seed
    assert len(a) == 5 and all(len(c.turns[0].split()) == 10 for c in a)
    assert all(c.output_lens == [7] and c.system is None for c in a)
    doc = build("long-document", 2, LengthSpec(1500, 1500), LengthSpec(32, 32))
    assert len(doc[0].turns[0].split()) > 1500 and "Summarise" in doc[0].turns[0]
    with pytest.raises(ValueError, match="unknown dataset"):
        build("sharegpt", 1, LengthSpec(1, 1), LengthSpec(1, 1))


def test_shared_prefix_conversations_resend_their_history() -> None:
    convs = build("shared-prefix", 10, LengthSpec(8, 8), LengthSpec(4, 4), turns=4)
    assert [len(c.turns) for c in convs] == [4, 4, 2]
    assert len({c.system for c in convs}) == 1  # one system prompt shared by all
    c = convs[0]
    first = c.messages(0)
    assert [m["role"] for m in first] == ["system", "user"]
    c.answered(0, "an answer")
    second = c.messages(1)
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[:2] == first and second[2]["content"] == "an answer"
