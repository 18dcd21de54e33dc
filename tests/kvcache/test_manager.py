"""KVCacheManager: allocation arithmetic, prefix hits, the last-token rule, salts."""

from __future__ import annotations

import pytest

from sendpath.kvcache.hashing import block_hashes, hash_block
from sendpath.kvcache.manager import KVCacheManager
from tests.factories import make_request


def compute_all(kv: KVCacheManager, request_id: str, prompt: list[int]) -> None:
    req = make_request(request_id, prompt)
    assert kv.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    kv.free(req)


def test_hashes_chain_and_salt() -> None:
    tokens = list(range(12))
    hs = block_hashes(tokens, 4)
    assert hs[0] == hash_block(None, tokens[:4])
    assert hs[1] == hash_block(hs[0], tokens[4:8])
    assert block_hashes(tokens, 4, salt="tenant-a") != hs
    assert block_hashes([99, *tokens[1:]], 4)[2] != hs[2]  # a change early changes every later hash


def test_allocate_slots_rounds_up_to_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    req = make_request("a", 10)
    new = kv.allocate_slots(req, 10)
    assert new is not None and new == [0, 1, 2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # fits in the third block
    req.num_computed_tokens = 12
    new = kv.allocate_slots(req, 1)
    assert new is not None and new == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.allocate_slots(make_request("b", 8), 8) is None  # only 1 block left
    kv.free(req)
    assert kv.pool.free_block_ids() == [4, 3, 2, 1, 0]


def test_append_blocks_gives_one_block_each_in_the_order_asked() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = make_request("a", 4), make_request("b", 8)
    assert kv.allocate_slots(a, 4) is not None and kv.allocate_slots(b, 8) is not None
    kv.append_blocks(["b", "a"])  # as allocate_slots(b, 1) then allocate_slots(a, 1) would
    assert kv.block_ids("a") == [0, 4] and kv.block_ids("b") == [1, 2, 3]
    with pytest.raises(RuntimeError, match="2 blocks asked for"):
        kv.append_blocks(["a", "b"])  # one free
    assert kv.pool.num_free_blocks == 1


def test_grow_decodes_takes_a_block_for_each_full_one_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a, b, c = make_request("a", 4), make_request("b", 6), make_request("c", 8)
    for r in (a, b, c):
        assert kv.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    assert kv.pool.num_free_blocks == 0
    assert not kv.grow_decodes([a, b, c])  # a and c need one each, none free
    assert kv.block_ids("a") == [0] and kv.block_ids("c") == [3, 4]
    assert kv.grow_decodes([b])  # room left in its second block
    assert kv.block_ids("b") == [1, 2] and kv.pool.num_free_blocks == 0
    kv.free(b)  # its 2 blocks back (2 first): a and c need 2
    assert kv.grow_decodes([c, a])  # in this order, as allocate_slots(_, 1) one by one
    assert kv.block_ids("c") == [3, 4, 2] and kv.block_ids("a") == [0, 1]
    assert not kv.grow_decodes([make_request("d", 4)])  # holds no blocks: one at a time


def test_prefix_hit_lengths_and_last_token_rule() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    compute_all(kv, "first", prompt)
    # same 12 tokens: 3 full blocks cached, but the last token must be computed -> 2 blocks
    hits, n = kv.get_computed_blocks(make_request("same", prompt))
    assert n == 8 and hits == [0, 1]
    # longer prompt sharing 12 tokens: all 3 blocks
    hits, n = kv.get_computed_blocks(make_request("longer", [*prompt, 50, 51]))
    assert n == 12 and hits == [0, 1, 2]
    # diverging inside block 2: hits stop at block 1
    _, n = kv.get_computed_blocks(make_request("diverge", [*prompt[:9], 77, 78, 79, 80]))
    assert n == 8
    # another tenant sees nothing
    _, n = kv.get_computed_blocks(make_request("other", [*prompt, 50], salt="tenant-b"))
    assert n == 0


def test_hit_blocks_are_shared_and_ref_counted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    compute_all(kv, "first", prompt)
    req = make_request("second", [*prompt, 1, 2])
    hits, n = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, 10 - n, hits)
    assert new is not None and len(new) == 1
    assert [kv.pool.ref_cnt(b) for b in hits] == [1, 1]
    assert kv.block_ids("second")[:2] == hits
    third = make_request("third", [*prompt, 3])
    hits3, _ = kv.get_computed_blocks(third)
    assert kv.allocate_slots(third, 1, hits3) is not None
    assert [kv.pool.ref_cnt(b) for b in hits] == [2, 2]
    kv.free(req)
    kv.free(third)
    assert kv.pool.num_free_blocks == 8


def test_free_cached_hits_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    compute_all(kv, "first", list(range(8)))  # blocks 0, 1 cached and free
    req = make_request("second", [*range(8), 9, 9, 9, 9, 9])
    hits, n = kv.get_computed_blocks(req)
    assert n == 8
    # 13 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free beside the hits
    assert kv.allocate_slots(req, 5, hits) is None
    assert [kv.pool.ref_cnt(b) for b in hits] == [0, 0]  # a failed allocation takes nothing


def test_events_record_stored_runs_and_evictions_exactly() -> None:
    from sendpath.kvcache.events import BlockRemoved, BlockStored

    kv = KVCacheManager(num_blocks=8, block_size=2)
    compute = make_request("other", [9, 9, 3])
    assert kv.allocate_slots(compute, 3) == [0, 1]
    compute.num_computed_tokens = 3
    kv.cache_computed_blocks(compute)  # block 0 indexed under [9, 9]'s hash
    kv.events = []
    req = make_request("a", [9, 9, 3, 4, 5, 6, 7])
    assert kv.allocate_slots(req, 7) == [2, 3, 4, 5]
    assert kv.events == []  # blocks never used: nothing evicted
    h = block_hashes([9, 9, 3, 4, 5, 6], 2)
    req.num_computed_tokens = 7
    kv.cache_computed_blocks(req)  # its block 2 holds [9, 9] too: a duplicate, not indexed
    # the run of newly indexed blocks starts after the duplicate, its parent
    assert kv.events == [BlockStored([h[1], h[2]], h[0], [3, 4, 5, 6], 2)]
    kv.events.clear()
    kv.free(req)  # freed: still indexed, nothing to say
    kv.free(compute)
    assert kv.events == [] and kv.pool.free_block_ids() == [6, 7, 5, 4, 3, 2, 1, 0]
    assert kv.allocate_slots(make_request("b", 10), 10) == [6, 7, 5, 4, 3]
    assert kv.events == [BlockRemoved([h[2], h[1]])]
