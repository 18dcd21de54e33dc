"""Routing policies on plain endpoints: round robin, least load, prefix-aware."""

from __future__ import annotations

import random

import pytest

from sendpath.router import prefix_aware
from sendpath.router.policy import LeastLoad, RoundRobin, make_policy
from sendpath.router.pool import Endpoint
from sendpath.router.prefix_aware import BLOCK_CHARS, PrefixAware
from sendpath.router.route import RouteRequest

SYSTEM = "system\nYou are a helpful assistant who answers in one short sentence.\n" * 4


def endpoints(n: int = 3) -> list[Endpoint]:
    return [Endpoint(i, f"http://r{i}", 8) for i in range(n)]


def chat(*turns: str) -> RouteRequest:
    return RouteRequest(SYSTEM + "".join(f"user\n{t}\n" for t in turns))


def test_round_robin_cycles_and_skips_what_cannot_take_it() -> None:
    eps, rr = endpoints(), RoundRobin()
    assert [rr.choose(chat(), eps).index for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose(chat(), [eps[0], eps[2]]).index == 2
    assert rr.choose(chat(), [eps[0], eps[2]]).index == 0


def test_round_robin_picks_the_first_candidate_after_the_last_choice_in_a_large_fleet() -> None:
    fleet = endpoints(128)
    rr, rng, last = RoundRobin(), random.Random(7), -1
    for _ in range(500):  # the reference: a scan from the start of the candidates
        candidates = [e for e in fleet if rng.random() < 0.3] or fleet[:1]
        expected = next((e for e in candidates if e.index > last), candidates[0])
        assert rr.choose(chat(), candidates) is expected
        last = expected.index


def test_least_load_uses_in_flight_or_reported_load_and_rotates_ties() -> None:
    eps, ll = endpoints(), LeastLoad()
    eps[0].in_flight, eps[1].external_load, eps[2].in_flight = 2, 5, 2
    assert ll.choose(chat(), eps).index in (0, 2)
    eps[2].in_flight = 1
    assert ll.choose(chat(), eps).index == 2
    for e in eps:
        e.in_flight, e.external_load = 0, 0
    assert sorted(ll.choose(chat(), eps).index for _ in range(3)) == [0, 1, 2]


def route(policy: PrefixAware, request: RouteRequest, eps: list[Endpoint]) -> int:
    chosen = policy.choose(request, eps)
    policy.routed(request, chosen)
    return chosen.index


def test_prefix_aware_keeps_a_conversation_on_its_replica() -> None:
    eps, pa = endpoints(), PrefixAware()
    homes = []
    for c in range(8):
        homes.append(route(pa, chat(f"conversation {c} " * 8), eps))
        eps[homes[-1]].in_flight += 1
    # the shared system prompt draws new conversations to replica 0 until the load gap
    # passes BALANCE_ABS; then one seeds replica 1, one replica 2, and they spread by load
    assert homes == [0, 0, 0, 1, 2, 1, 2, 1]
    for c in range(8):  # the answer is remembered: each next turn follows its conversation
        turn = chat(f"conversation {c} " * 8)
        pa.routed(turn.answered(f"answer {c} " * 10), eps[homes[c]])
        nxt = RouteRequest(turn.answered(f"answer {c} " * 10).text + "user\nand then?\n")
        assert route(pa, nxt, eps) == homes[c]


def test_prefix_aware_falls_back_to_least_load() -> None:
    eps, pa = endpoints(2), PrefixAware()
    first = route(pa, chat("a long question " * 10), eps)
    other = 1 - first
    eps[first].in_flight = 2
    # too short to match a block: least loaded
    assert route(pa, RouteRequest("hi"), eps) == other
    # a new prompt (no match above the threshold): least loaded
    assert route(pa, RouteRequest("x" * 10 * BLOCK_CHARS), eps) == other
    # the same conversation sticks while the load gap is moderate...
    assert route(pa, chat("a long question " * 10, "more"), eps) == first
    # ...and leaves when it is large in absolute and relative terms
    eps[first].in_flight, eps[other].in_flight = 40, 2
    assert route(pa, chat("a long question " * 10, "more"), eps) == other


def test_prefix_aware_evicts_old_blocks_and_forgets_an_ejected_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_aware, "MAX_BLOCKS", 10)
    eps, pa = endpoints(1), PrefixAware()
    for c in range(5):
        pa.routed(RouteRequest(f"{c}" * 5 * BLOCK_CHARS), eps[0])
    assert len(pa.trees[0]) == 10  # the most recent blocks only
    assert pa.match(prefix_aware.block_hashes(RouteRequest("4" * 5 * BLOCK_CHARS)), eps[0]) == 5
    assert pa.match(prefix_aware.block_hashes(RouteRequest("0" * 5 * BLOCK_CHARS)), eps[0]) == 0
    pa.forget(eps[0])
    assert pa.trees == {}


def test_salted_prompts_do_not_match_across_tenants() -> None:
    text = "shared text " * 40
    a = prefix_aware.block_hashes(RouteRequest(text, "alice"))
    b = prefix_aware.block_hashes(RouteRequest(text, "bob"))
    assert len(a) == len(text) // BLOCK_CHARS and not set(a) & set(b)


def test_policy_registry() -> None:
    assert make_policy("least_load").name == "least_load"
    with pytest.raises(ValueError, match="round_robin, least_load, prefix_aware"):
        make_policy("random")
