"""The block pool: fixed-size KV blocks with ref counts, a prefix-hash index and an LRU queue.

A block is *free* when no request holds it (``ref_cnt == 0``). Free blocks wait in an LRU
queue, oldest-freed first out; a free block that still has a hash stays findable in the
prefix index until it is taken for new data, which is when its hash is dropped. So a
request that finished a moment ago still lends its prefix to the next one.

While ``events`` is a list, the pool appends to it what a router outside would need to
know of the index (``kvcache/events.py``): the blocks ``cache_all`` indexes and the hashes
``allocate`` evicts. ``None`` (the default, and the simulator's) records nothing.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sendpath.kvcache.events import BlockRemoved, BlockStored, KVEvent, WireHash
from sendpath.kvcache.hashing import BlockHash

__all__ = ["BlockPool", "KVBlock"]


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of ``block_size`` token slots in the KV cache tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    tokens: bytes = b""  # set once full and hashed: its token ids packed, for hit checks


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as int64 bytes: a full cache's worth of blocks holds no int objects."""
    return array("q", token_ids).tobytes()


class BlockPool:
    """Owns every block; hands them out, takes them back, and indexes full ones by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.enable_caching = enable_caching
        # Blocks are made when first handed out (a simulated fleet has millions): ids from
        # ``_fresh`` on were never used and come first, in id order; then the freed ones,
        # least recently freed first (an OrderedDict as an LRU set; values unused).
        self._blocks: list[KVBlock | None] = [None] * num_blocks
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self.events: list[KVEvent] | None = None  # a list: record index changes into it

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks) - self._fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix index (held or free)."""
        return len(self._cached)

    @property
    def blocks(self) -> list[KVBlock]:
        """Every block, in id order (made now if never used); for tests and stats."""
        return [b if b is not None else KVBlock(i) for i, b in enumerate(self._blocks)]

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first out first); for tests and stats."""
        return [*range(self._fresh, len(self._blocks)), *self._free]

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / len(self._blocks)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int] | bytes) -> KVBlock | None:
        """The cached block with this hash whose tokens really are ``token_ids`` (or these
        int64 bytes), if any."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        packed = token_ids if isinstance(token_ids, bytes) else _pack(token_ids)
        return block if block.tokens == packed else None

    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take ``n`` free blocks (evicting their cached hashes), or ``None`` if too few."""
        if n > self.num_free_blocks:
            return None
        blocks, free, cached = self._blocks, self._free, self._cached
        start = self._fresh
        end = min(start + n, len(blocks))
        out = list(map(KVBlock, range(start, end), itertools.repeat(1, end - start)))
        if out:  # never used before: made now, in id order
            blocks[start:end] = out
            self._fresh = end
        evicted: list[WireHash] = []
        for _ in range(n - len(out)):
            block_id, _ = free.popitem(last=False)
            block = blocks[block_id]
            assert block is not None  # it was handed out before it was freed
            if block.block_hash is not None:
                cached.pop(block.block_hash, None)
                evicted.append(block.block_hash)
                block.block_hash, block.tokens = None, b""
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(evicted))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the order given; ones reaching 0 join the LRU tail.

        Callers pass a request's blocks last-first, so a prefix's tail is evicted before its
        head, and the head (shared by the most requests) stays cached longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int] | bytes,
        parent: BlockHash | None = None,
    ) -> None:
        """Index a full block under its hash (first writer wins: duplicates stay private);
        ``token_ids`` may come packed already (int64 bytes)."""
        if self.enable_caching:
            packed = token_ids if isinstance(token_ids, bytes) else _pack(token_ids)
            self.cache_all([block], [block_hash], [packed], parent)

    def cache_all(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[BlockHash],
        packed: Sequence[bytes],
        parent: BlockHash | None = None,
    ) -> None:
        """``cache`` for each block, in order, with its hash and its token ids packed;
        ``parent`` is the hash of the block before the first (for the events)."""
        if not self.enable_caching:
            return
        cached, events = self._cached, self.events
        if events is not None:
            self._record_stored(blocks, hashes, packed, parent, events)
            return
        for block, block_hash, tokens in zip(blocks, hashes, packed, strict=True):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash, block.tokens = block_hash, tokens
                cached[block_hash] = block

    def _record_stored(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[BlockHash],
        packed: Sequence[bytes],
        parent: BlockHash | None,
        events: list[KVEvent],
    ) -> None:
        """``cache_all``, recording one ``BlockStored`` per run of blocks it indexes (a
        block already indexed under its hash, by another request, breaks the run)."""
        cached = self._cached
        run: list[WireHash] = []
        run_tokens: list[bytes] = []
        run_parent = parent

        def close() -> None:
            if run:
                ids = array("q", b"".join(run_tokens)).tolist()
                events.append(BlockStored(run.copy(), run_parent, ids, len(run_tokens[0]) // 8))
                run.clear()
                run_tokens.clear()

        for block, block_hash, tokens in zip(blocks, hashes, packed, strict=True):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash, block.tokens = block_hash, tokens
                cached[block_hash] = block
                run.append(block_hash)
                run_tokens.append(tokens)
            else:
                close()
                run_parent = block_hash
        close()
