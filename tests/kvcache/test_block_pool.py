"""BlockPool: exact block ids, ref counts, LRU order and the hash index."""

from __future__ import annotations

import pytest

from sendpath.kvcache.block_pool import BlockPool
from sendpath.kvcache.hashing import hash_block


def test_allocate_takes_lowest_free_ids_in_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a is not None and b is not None
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3, 4]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert pool.num_free_blocks == 1 and pool.allocate(2) is None
    assert pool.free_block_ids() == [5]
    assert pool.usage == pytest.approx(5 / 6)


def test_release_appends_to_lru_tail_in_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.release(reversed(blocks))  # a request frees its table last-first
    assert pool.free_block_ids() == [4, 3, 2, 1, 0]
    again = pool.allocate(2)
    assert again is not None and [b.block_id for b in again] == [4, 3]


def test_shared_block_is_freed_only_when_last_holder_releases() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1) or []
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.release([block])
    assert block.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.release([block])
    assert block.ref_cnt == 0 and pool.free_block_ids() == [1, 2, 0]
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_cached_free_block_is_found_then_evicted_on_reuse() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache(block, h, [1, 2, 3, 4])
    pool.release([block])
    assert pool.lookup(h, [1, 2, 3, 4]) is block  # freed, still cached
    assert pool.lookup(h, [1, 2, 3, 5]) is None  # tokens verified, not just the hash
    pool.touch([block])  # a hit takes it out of the free queue
    assert block.ref_cnt == 1 and pool.free_block_ids() == [1]
    pool.release([block])
    taken = pool.allocate(2)  # block 1 first (older in the LRU), then block 0: evicted
    assert taken is not None and [b.block_id for b in taken] == [1, 0]
    assert pool.lookup(h, [1, 2, 3, 4]) is None and block.block_hash is None


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    h = hash_block(None, [7])
    pool.cache(a, h, [7])
    pool.cache(b, h, [7])
    assert pool.lookup(h, [7]) is a and b.block_hash is None


def test_events_record_stored_runs_and_evictions_exactly() -> None:
    from sendpath.kvcache.events import BlockRemoved, BlockStored

    pool = BlockPool(4)
    pool.events = []
    blocks = pool.allocate(3)
    assert blocks is not None
    h = [hash_block(None, [1, 2])]
    h.append(hash_block(h[0], [3, 4]))
    h.append(hash_block(h[1], [5, 6]))
    pool.cache(blocks[0], h[0], [9, 9])  # block 0 is indexed already
    pool.events.clear()
    other = pool.allocate(1)
    assert other is not None
    pool.cache_all(blocks, h, [_ids(1, 2), _ids(3, 4), _ids(5, 6)])
    # the run of newly indexed blocks starts after block 0, its parent
    assert pool.events == [BlockStored([h[1], h[2]], h[0], [3, 4, 5, 6], 2)]
    pool.events.clear()
    pool.release(reversed(blocks))  # freed: still indexed, nothing to say
    assert pool.events == []
    assert pool.allocate(2) is not None  # evicts the two tail blocks' hashes
    assert pool.events == [BlockRemoved([h[2], h[1]])]


def test_no_events_are_recorded_unless_asked() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    pool.cache(block, hash_block(None, [1]), [1])
    assert pool.events is None


def _ids(*tokens: int) -> bytes:
    from array import array

    return array("q", tokens).tobytes()
