"""The index of what publishing replicas hold: events in order, guesses that expire, and
the prefix-aware policy matching exactly where it can and approximately elsewhere."""

from __future__ import annotations

from sendpath.clock import SettableClock
from sendpath.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from sendpath.kvcache.hashing import block_hashes
from sendpath.router.kv_index import GUESS_TTL_S, KVIndex
from sendpath.router.pool import Endpoint
from sendpath.router.prefix_aware import PrefixAware
from sendpath.router.route import RouteRequest

BS = 4
PROMPT = tuple(range(100, 121))  # 21 tokens: 5 full blocks a replica could serve


def request(ids: tuple[int, ...] = PROMPT, salt: str | None = None) -> RouteRequest:
    return RouteRequest("user\nhello\n", salt, token_ids=ids)


def test_events_apply_in_order_and_match_counts_leading_blocks() -> None:
    index = KVIndex(SettableClock())
    index.follow(0, BS)
    hashes = block_hashes(PROMPT, BS)
    index.apply(0, [BlockStored(list(hashes[:3]), None, list(PROMPT[:12]), BS)])
    assert index.match(0, hashes) == 3 and index.num_blocks(0) == 3
    index.apply(0, [BlockRemoved([hashes[1]])])
    assert index.match(0, hashes) == 1  # a hole ends the prefix
    index.apply(0, [AllBlocksCleared()])
    assert index.match(0, hashes) == 0 and index.num_blocks(0) == 0
    index.apply(1, [BlockStored([hashes[0]], None, list(PROMPT[:4]), BS)])  # not followed
    assert index.block_size(1) is None and index.match(1, hashes) == 0


def test_a_guess_counts_until_it_expires_or_the_events_say_otherwise() -> None:
    clock = SettableClock()
    index = KVIndex(clock)
    index.follow(0, BS)
    hashes = block_hashes(PROMPT, BS)
    index.guess(0, hashes)
    assert index.match(0, hashes) == len(hashes)
    index.apply(0, [BlockRemoved([hashes[2]])])  # evicted before it was confirmed
    assert index.match(0, hashes) == 2
    clock.set(GUESS_TTL_S + 0.01)
    assert index.match(0, hashes) == 0
    index.forget(0)
    index.guess(0, hashes)  # not followed: no guess either
    assert index.match(0, hashes) == 0


def test_prefix_aware_routes_on_the_index_where_replicas_publish() -> None:
    index = KVIndex(SettableClock())
    eps = [Endpoint(i, f"http://r{i}", 8) for i in range(3)]
    index.follow(1, BS)
    index.follow(2, BS)
    policy = PrefixAware(index)
    salted = request(salt="tenant-a")
    held = salted.token_hashes(BS)
    assert held == block_hashes(PROMPT[:-1], BS, "tenant-a")  # never the last token
    index.apply(2, [BlockStored(list(held), None, list(PROMPT[:20]), BS)])
    assert policy.choose(salted, eps).index == 2
    assert policy.matched(salted, eps[2]) == (5, 5, True)
    assert policy.matched(request(), eps[2]) == (0, 5, True)  # another tenant's salt
    assert policy.matched(salted, eps[0])[2] is False  # publishes nothing: approximate
    # without token ids (the gateway could not learn them) every match is approximate
    plain = RouteRequest("user\nhello\n", "tenant-a")
    assert policy.matched(plain, eps[2])[2] is False


def test_routing_a_new_prefix_guesses_it_for_the_next_request() -> None:
    index = KVIndex(SettableClock())
    eps = [Endpoint(i, f"http://r{i}", 8) for i in range(2)]
    for e in eps:
        index.follow(e.index, BS)
    policy = PrefixAware(index)
    first = policy.choose(request(), eps)
    policy.routed(request(), first)
    eps[first.index].in_flight = 1  # busy with it, and still the one that will hold it
    assert policy.choose(request(), eps) is first
