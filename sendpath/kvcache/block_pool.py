"""The block pool: fixed-size KV blocks with ref counts, a prefix-hash index and an LRU queue.

A block is an int id. It is *free* when no request holds it (ref count 0). Free blocks
wait in an LRU queue, oldest-freed first out; a free block that still has a hash stays
findable in the prefix index until it is taken for new data, which is when its hash is
dropped. So a request that finished a moment ago still lends its prefix to the next one.

Two implementations with one behaviour: ``kv_native.c``'s (built where a C compiler is
found, ``kvcache/native.py``) and ``BlockPool`` here, the reference the tests hold the C
one to. ``make_pool`` gives the C one where it was built. Where a caller wants the prefix
index's changes (KV events), ``allocate`` reports the hashes it evicts and ``cache_all``
which blocks it indexed; the manager turns them into events.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from sendpath.kvcache.events import WireHash
from sendpath.kvcache.hashing import BlockHash

__all__ = ["BlockPool", "Pool", "make_pool"]


class Pool(Protocol):
    """What the manager asks of a block pool (both implementations)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def enable_caching(self) -> bool: ...
    def allocate(self, n: int, evicted: list[WireHash] | None = None, /) -> list[int] | None: ...
    def touch(self, block_ids: Iterable[int], /) -> None: ...
    def release(self, block_ids: Iterable[int], /) -> None: ...
    def longest_hit(
        self, hashes: Sequence[BlockHash], packed: Sequence[bytes], limit: int, /
    ) -> list[int]: ...
    def cache_all(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        packed: Sequence[bytes],
        indexed: list[bool] | None = None,
        /,
    ) -> None: ...
    def num_free_of(self, block_ids: Iterable[int], /) -> int: ...
    def ref_cnt(self, block_id: int, /) -> int: ...
    def block_hash(self, block_id: int, /) -> BlockHash | None: ...
    def free_block_ids(self, limit: int | None = None, /) -> list[int]: ...


def make_pool(num_blocks: int, enable_caching: bool = True) -> Pool:
    """The C pool where ``kv_native.c`` was built, else ``BlockPool``."""
    from sendpath.kvcache.native import kv_native

    if kv_native is not None:
        pool: Pool = kv_native.BlockPool(num_blocks, enable_caching)
        return pool
    return BlockPool(num_blocks, enable_caching)


class BlockPool:
    """Owns every block; hands them out, takes them back, and indexes full ones by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_blocks > 2**31 - 1:
            raise ValueError(f"num_blocks must be < 2**31, got {num_blocks}")
        self._caching = bool(enable_caching)
        self._n = num_blocks
        # ids from ``_fresh`` on were never handed out and come first, in id order (a
        # simulated fleet has millions); then the freed ones, least recently freed first
        # (an OrderedDict as an LRU set; values unused)
        self._fresh = 0
        self._ref: list[int] = []  # of the blocks handed out so far
        self._hash: list[BlockHash | None] = []
        self._tokens: list[bytes] = []  # an indexed block's token ids, packed: hit checks
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return self._n

    @property
    def num_free_blocks(self) -> int:
        return self._n - self._fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix index (held or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self._n

    @property
    def enable_caching(self) -> bool:
        return self._caching

    def free_block_ids(self, limit: int | None = None) -> list[int]:
        """Free block ids in allocation order (never used ones, then the least recently
        freed), the first ``limit`` of them where given."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        fresh = range(self._fresh, self._n)
        if limit is None:
            return [*fresh, *self._free]
        return [*fresh[:limit], *itertools.islice(self._free, max(0, limit - len(fresh)))]

    def _checked(self, block_ids: Iterable[int]) -> list[int]:
        """The ids, every one handed out before (else ``ValueError``, and nothing changed)."""
        ids = list(block_ids)
        for block in ids:
            if not 0 <= block < self._fresh:
                raise ValueError(f"block {block} was never handed out")
        return ids

    def ref_cnt(self, block_id: int) -> int:
        if not 0 <= block_id < self._n:
            raise IndexError(f"no block {block_id} in a pool of {self._n}")
        return self._ref[block_id] if block_id < self._fresh else 0

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash the block is indexed under, if it is."""
        if not 0 <= block_id < self._n:
            raise IndexError(f"no block {block_id} in a pool of {self._n}")
        return self._hash[block_id] if block_id < self._fresh else None

    def num_free_of(self, block_ids: Iterable[int]) -> int:
        """How many of these (handed out before) are free now."""
        ref = self._ref
        return sum(1 for b in self._checked(block_ids) if ref[b] == 0)

    def longest_hit(
        self, hashes: Sequence[BlockHash], packed: Sequence[bytes], limit: int, /
    ) -> list[int]:
        """The cached blocks of the longest run of ``hashes[:limit]`` whose token ids
        really are ``packed``'s (int64 bytes, one per hash; lists or tuples): a request's
        prefix hit."""
        limit = operator.index(limit)
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if not isinstance(hashes, list | tuple) or not isinstance(packed, list | tuple):
            raise TypeError("hashes and packed must be lists or tuples")
        if len(hashes) != len(packed):
            raise ValueError(f"longest_hit: {len(hashes)} hashes, {len(packed)} packed")
        hits: list[int] = []
        cached, tokens = self._cached, self._tokens
        for block_hash, ids in zip(hashes[:limit], packed, strict=False):
            if type(block_hash) is not bytes or type(ids) is not bytes:
                break  # only bytes are ever indexed
            block = cached.get(block_hash)
            if block is None or tokens[block] != ids:
                break
            hits.append(block)
        return hits

    def allocate(self, n: int, evicted: list[WireHash] | None = None) -> list[int] | None:
        """Take ``n`` free blocks, or ``None`` if too few. The hashes of indexed blocks
        taken leave the index (appended to ``evicted`` if given)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            return None
        start = self._fresh
        end = min(start + n, self._n)
        out = list(range(start, end))
        if out:  # never used before: in id order
            self._fresh = end
            self._ref += [1] * len(out)
            self._hash += [None] * len(out)
            self._tokens += [b""] * len(out)
        free, ref, hashes = self._free, self._ref, self._hash
        for _ in range(n - len(out)):
            block, _ = free.popitem(last=False)
            block_hash = hashes[block]
            if block_hash is not None:
                del self._cached[block_hash]
                if evicted is not None:
                    evicted.append(block_hash)
                hashes[block], self._tokens[block] = None, b""
            ref[block] = 1
            out.append(block)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the LRU."""
        ref = self._ref
        for block in self._checked(block_ids):
            if ref[block] == 0:
                del self._free[block]
            ref[block] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given; ones reaching 0 join the LRU tail.

        Callers pass a request's blocks last-first, so a prefix's tail is evicted before its
        head, and the head (shared by the most requests) stays cached longest.
        """
        ref = self._ref
        for block in self._checked(block_ids):
            count = ref[block]
            if count <= 0:
                raise RuntimeError(f"block {block} released more often than taken")
            ref[block] = count - 1
            if count == 1:
                self._free[block] = None

    def cache_all(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        packed: Sequence[bytes],
        indexed: list[bool] | None = None,
    ) -> None:
        """Index each block under its hash with its token ids packed, in order (first
        writer wins: a block already indexed, or a hash already known, stays as it is);
        ``indexed`` gets, for each, whether it was indexed now."""
        if not self._caching:
            return
        if not len(block_ids) == len(hashes) == len(packed):
            raise ValueError(
                f"cache_all: {len(block_ids)} blocks, {len(hashes)} hashes, {len(packed)} packed"
            )
        cached, own = self._cached, self._hash
        if any(type(h) is not bytes for h in hashes) or any(type(t) is not bytes for t in packed):
            raise TypeError("hashes and packed token ids must be bytes")
        for block, block_hash, tokens in zip(self._checked(block_ids), hashes, packed, strict=True):
            now = own[block] is None and block_hash not in cached
            if now:
                own[block], self._tokens[block] = block_hash, tokens
                cached[block_hash] = block
            if indexed is not None:
                indexed.append(now)
