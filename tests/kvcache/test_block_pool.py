"""The block pool, both implementations (Python's ``BlockPool`` and ``kv_native.c``'s):
exact block ids, ref counts, LRU order and the hash index; and the two against each other
on random operations."""

from __future__ import annotations

import gc
import random
from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sendpath.kvcache.block_pool import BlockPool, Pool
from sendpath.kvcache.events import WireHash
from sendpath.kvcache.hashing import hash_block

MakePool = Callable[..., Pool]


@pytest.fixture(params=["python", "c"])
def make(request: pytest.FixtureRequest) -> MakePool:
    if request.param == "python":
        return BlockPool
    native: ModuleType = request.getfixturevalue("native_kv")
    made: MakePool = native.BlockPool
    return made


def _ids(*tokens: int) -> bytes:
    return array("q", tokens).tobytes()


def test_allocate_takes_lowest_free_ids_in_order(make: MakePool) -> None:
    pool = make(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert [pool.ref_cnt(x) for x in a + b] == [1] * 5 and pool.ref_cnt(5) == 0
    assert pool.num_free_blocks == 1 and pool.allocate(2) is None
    assert pool.free_block_ids() == [5]
    assert pool.usage == pytest.approx(5 / 6)
    assert pool.allocate(0) == []


def test_release_appends_to_lru_tail_in_given_order(make: MakePool) -> None:
    pool = make(5)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.release(blocks[::-1])  # a request frees its table last-first
    assert pool.free_block_ids() == [4, 3, 2, 1, 0]
    assert pool.allocate(2) == [4, 3]


def test_free_block_ids_are_the_allocation_order_and_a_limit_takes_its_front(
    make: MakePool,
) -> None:
    pool = make(6)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.release(blocks[:2][::-1])  # never used 4 and 5 go first, then the freed 1, 0
    order = pool.free_block_ids()
    assert order == [4, 5, 1, 0] and pool.free_block_ids(None) == order
    assert [pool.free_block_ids(n) for n in (0, 1, 3, 9)] == [[], [4], [4, 5, 1], order]
    with pytest.raises(ValueError, match="limit must be >= 0"):
        pool.free_block_ids(-1)
    assert pool.allocate(3) == order[:3]


def test_shared_block_is_freed_only_when_last_holder_releases(make: MakePool) -> None:
    pool = make(3)
    (block,) = pool.allocate(1) or []
    pool.touch([block])
    assert pool.ref_cnt(block) == 2
    pool.release([block])
    assert pool.ref_cnt(block) == 1 and 0 not in pool.free_block_ids()
    pool.release([block])
    assert pool.ref_cnt(block) == 0 and pool.free_block_ids() == [1, 2, 0]
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_cached_free_block_is_found_then_evicted_on_reuse(make: MakePool) -> None:
    pool = make(2)
    (block,) = pool.allocate(1) or []
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_all([block], [h], [_ids(1, 2, 3, 4)])
    pool.release([block])
    assert pool.longest_hit([h], [_ids(1, 2, 3, 4)], 1) == [block]  # freed, still cached
    assert pool.longest_hit([h], [_ids(1, 2, 3, 5)], 1) == []  # tokens verified, not just the hash
    assert pool.num_free_of([block]) == 1
    pool.touch([block])  # a hit takes it out of the free queue
    assert pool.ref_cnt(block) == 1 and pool.free_block_ids() == [1]
    pool.release([block])
    evicted: list[WireHash] = []
    assert pool.allocate(2, evicted) == [1, 0]  # block 1 first (older in the LRU), then 0
    assert evicted == [h] and pool.longest_hit([h], [_ids(1, 2, 3, 4)], 1) == []
    assert pool.block_hash(block) is None and pool.num_cached_blocks == 0


def test_longest_hit_walks_a_chain_to_its_first_miss(make: MakePool) -> None:
    pool = make(4)
    blocks = pool.allocate(3) or []
    chain = [hash_block(None, [1]), hash_block(None, [2]), hash_block(None, [3])]
    packed = [_ids(1), _ids(2), _ids(3)]
    pool.cache_all(blocks, chain, packed)
    assert pool.longest_hit(chain, packed, 3) == blocks
    assert pool.longest_hit(chain, packed, 2) == blocks[:2]  # the limit: one token to compute
    assert pool.longest_hit(chain, packed, 0) == [] == pool.longest_hit([], [], 5)
    assert pool.longest_hit(chain, [packed[0], _ids(9), packed[2]], 3) == blocks[:1]
    other = [chain[0], hash_block(None, [8]), chain[2]]
    assert pool.longest_hit(other, packed, 3) == blocks[:1]  # a later hit does not count
    pool.release(blocks)
    pool.allocate(2)  # the fresh block, then the oldest freed: blocks[0] leaves the index
    assert pool.longest_hit(chain, packed, 3) == []


def test_longest_hit_refuses_bad_arguments(make: MakePool) -> None:
    pool = make(2)
    with pytest.raises(ValueError, match="limit must be >= 0"):
        pool.longest_hit([], [], -1)
    with pytest.raises(ValueError, match="2 hashes, 1 packed"):
        pool.longest_hit([b"h" * 16, b"i" * 16], [b"t"], 1)
    with pytest.raises(TypeError, match="lists or tuples"):
        pool.longest_hit(iter([b"h" * 16]), [b"t"], 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.longest_hit([], [], 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.longest_hit([], [], limit=1)  # type: ignore[call-arg]
    assert pool.longest_hit((), (), 2**70) == []  # a limit past any list is no limit


def test_duplicate_hash_keeps_first_block(make: MakePool) -> None:
    pool = make(2)
    a, b = pool.allocate(2) or []
    h = hash_block(None, [7])
    indexed: list[bool] = []
    pool.cache_all([a, b, a], [h, h, hash_block(None, [8])], [_ids(7)] * 3, indexed)
    assert indexed == [True, False, False]  # b: the hash is a's; a: indexed already
    assert pool.longest_hit([h], [_ids(7)], 1) == [a] and pool.block_hash(b) is None


def test_a_pool_without_caching_indexes_nothing(make: MakePool) -> None:
    pool = make(2, False)
    (a,) = pool.allocate(1) or []
    h = hash_block(None, [7])
    pool.cache_all([a], [h], [_ids(7)])
    assert not pool.enable_caching and pool.longest_hit([h], [_ids(7)], 1) == []


def test_bad_calls_are_refused_and_change_nothing(make: MakePool) -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        make(0)
    pool = make(4)
    assert pool.allocate(2) == [0, 1]
    with pytest.raises(ValueError, match="never handed out"):
        pool.release([0, 2])  # a bad id anywhere: block 0 is not released either
    assert pool.ref_cnt(0) == 1
    with pytest.raises(ValueError, match="never handed out"):
        pool.touch([-1])
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="2 blocks, 1 hashes"):
        pool.cache_all([0, 1], [b"h"], [b"t", b"t"])
    with pytest.raises(IndexError, match="no block 4"):
        pool.ref_cnt(4)
    with pytest.raises(TypeError, match="must be bytes"):
        pool.cache_all([0], [Hash(b"h" * 16)], [b"t"])
    assert pool.free_block_ids() == [2, 3] and pool.num_cached_blocks == 0
    assert pool.longest_hit([Hash(b"h" * 16)], [b"t"], 1) == []


class Hash(bytes):
    """A bytes subclass: its own ``__hash__`` could run mid-change, so it is refused."""

    def __hash__(self) -> int:
        return 7


def test_the_c_pool_is_made_whole_or_not_at_all(native_kv: ModuleType) -> None:
    with pytest.raises(TypeError):
        native_kv.BlockPool.__new__(native_kv.BlockPool)
    with pytest.raises(ValueError, match="num_blocks must be < 2"):
        native_kv.BlockPool(2**31)
    with pytest.raises(TypeError):

        class Mine(native_kv.BlockPool):  # type: ignore[misc,name-defined]
            pass


# ---------------------------------------------------------------- C against Python

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 6)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("touch"), st.integers(0, 40)),
        st.tuples(st.just("cache"), st.integers(0, 40), st.integers(0, 5)),
        st.tuples(
            st.just("hit"),
            st.lists(st.integers(0, 5), max_size=4),  # the keys of a chain of blocks
            st.integers(0, 5),  # the limit
            st.integers(-1, 3),  # the block whose token ids are wrong (-1: none)
        ),
    ),
    max_size=80,
)


def _run(pool: Pool, ops: list[tuple[Any, ...]]) -> list[object]:
    """Apply ``ops`` (ids picked among the blocks each one holds), recording every answer
    and the pool's state after each."""
    held: list[int] = []  # one entry per reference taken
    seen: list[object] = []
    for op, *args in ops:
        if op == "allocate":
            evicted: list[WireHash] = []
            got = pool.allocate(int(args[0]), evicted)
            held += got or []
            seen.append((got, evicted))
        elif op in ("release", "touch") and held:
            block = held[int(args[0]) % len(held)]
            if op == "release":
                held.remove(block)
                pool.release([block])
            else:
                held.append(block)
                pool.touch([block])
        elif op == "cache" and held:
            block, key = held[int(args[0]) % len(held)], int(args[1])
            indexed: list[bool] = []
            pool.cache_all([block], [bytes([key]) * 16], [_ids(key)], indexed)
            seen.append(indexed)
        elif op == "hit":
            keys, limit, wrong = args
            hashes = [bytes([k]) * 16 for k in keys]
            packed = [_ids(k + (i == wrong)) for i, k in enumerate(keys)]
            seen.append(pool.longest_hit(hashes, packed, limit))
        blocks = range(pool.num_blocks)
        seen.append(
            (
                pool.free_block_ids(),
                [pool.ref_cnt(b) for b in blocks],
                [pool.block_hash(b) for b in blocks],
                pool.num_free_blocks,
                pool.num_cached_blocks,
                pool.usage,
            )
        )
    return seen


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(1, 8))
def test_the_c_pool_does_what_the_python_one_does(
    native_kv: ModuleType, ops: list[tuple[Any, ...]], num_blocks: int
) -> None:
    assert _run(native_kv.BlockPool(num_blocks), ops) == _run(BlockPool(num_blocks), ops)


def test_the_c_pools_index_holds_up_when_full_and_churning(native_kv: ModuleType) -> None:
    """The C index is open addressing: a pool whose every block is indexed, with blocks
    evicted and re-indexed under other hashes thousands of times, finds exactly what
    the Python pool (a dict) finds."""
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(1000)]
    pools = [native_kv.BlockPool(256), BlockPool(256)]
    answers: list[list[object]] = [[], []]
    for _ in range(300):
        n = rng.randrange(1, 64)
        picked = rng.sample(keys, n)
        probes = rng.sample(keys, 32)
        for pool, seen in zip(pools, answers, strict=True):
            evicted: list[WireHash] = []
            blocks = pool.allocate(n, evicted)
            indexed: list[bool] = []
            pool.cache_all(blocks, picked, [_ids(k[0]) for k in picked], indexed)
            seen += [blocks, evicted, indexed, pool.num_cached_blocks]
            seen += [pool.longest_hit([k], [_ids(k[0])], 1) for k in probes]
            pool.release(blocks[::-1])
    assert answers[0] == answers[1]
    assert pools[0].num_cached_blocks == pools[1].num_cached_blocks > 200
    hashes = [[p.block_hash(b) for b in range(256)] for p in pools]
    assert hashes[0] == hashes[1]


def _collect_during(call: Callable[[], object], finalizer: Callable[[], object]) -> object:
    """``call()`` with the collector due at its first allocation of a tracked object,
    and a cycle whose finalizer runs ``finalizer`` (once) then."""
    ran: list[bool] = []

    class Cycle:
        def __del__(self) -> None:
            if not ran:
                ran.append(True)
                finalizer()

    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.disable()
    cycle = Cycle()
    cycle.me = cycle  # type: ignore[attr-defined]
    del cycle
    young: list[list[int]] = [
        [] for _ in range(200)
    ]  # the collector's count well past its threshold
    try:
        gc.set_threshold(1)
        gc.enable()
        out = call()
    finally:
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()
    if not (ran and young):  # 3.12 on: the collector waits for the next bytecode
        pytest.skip("this Python never runs the collector inside a C call")
    return out


def test_the_c_pool_reads_its_state_after_making_its_answer(native_kv: ModuleType) -> None:
    """A finalizer the collector runs while the pool makes its answer list may change
    the pool: the answer is then that of the pool as it is after, never a stale one."""
    pool = native_kv.BlockPool(8)
    pool.allocate(4)
    assert _collect_during(lambda: pool.allocate(4), lambda: pool.allocate(4)) is None
    held = pool.allocate(0)
    assert held == [] and pool.num_free_blocks == 0
    other = native_kv.BlockPool(8)
    taken = other.allocate(8)
    assert _collect_during(other.free_block_ids, lambda: other.release(taken)) == list(range(8))


def test_the_c_pool_walks_a_prefix_as_the_pool_is_after_a_collection(
    native_kv: ModuleType,
) -> None:
    """A finalizer the collector runs while ``longest_hit`` makes its answer list may
    evict the blocks it would find: the answer is the pool's after, not a stale hit."""
    pool = native_kv.BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block(None, [5])
    pool.cache_all([block], [h], [_ids(5)])
    pool.release([block])
    hashes, packed = [h], [_ids(5)]  # made before: the collector runs inside the call
    hit = _collect_during(lambda: pool.longest_hit(hashes, packed, 1), lambda: pool.allocate(2))
    assert hit == [] and pool.num_cached_blocks == 0


def test_the_c_pool_walks_inputs_as_they_are_after_a_collection(native_kv: ModuleType) -> None:
    """A finalizer that empties the inputs while the answer list is made: the walk reads
    them as they are then (nothing past their end)."""
    pool = native_kv.BlockPool(2)
    blocks = pool.allocate(2)
    chain, packed = [hash_block(None, [5]), hash_block(None, [6])], [_ids(5), _ids(6)]
    pool.cache_all(blocks, chain, packed)

    def empty() -> None:
        chain.clear()
        packed.clear()

    assert _collect_during(lambda: pool.longest_hit(chain, packed, 2), empty) == []
