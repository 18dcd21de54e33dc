"""The KV cache manager: which blocks each request holds, and the prefix cache in front of them.

The scheduler asks two questions and never sees a free list:
``get_computed_blocks(request)`` (how much of this request is already cached?) and
``allocate_slots(request, n, hits)`` (room for n more tokens: new blocks, or ``None`` =
cannot, preempt someone). Full blocks become findable by later requests once computed
(``cache_computed_blocks``). The last prompt token is never served from cache: its forward
pass is what produces the first output token.

While ``events`` is a list, the manager appends to it what a router outside would need to
know of the prefix index (``kvcache/events.py``): the blocks it indexes and the hashes
the pool evicts. ``None`` (the default, and the simulator's) records nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sendpath.kvcache.block_pool import Pool, make_pool
from sendpath.kvcache.events import BlockRemoved, KVEvent, WireHash, stored_runs
from sendpath.kvcache.hashing import BlockHash, block_hashes
from sendpath.request import Request

__all__ = ["KVCacheManager"]


def _blocks_beyond(tokens: int, block_size: int, held: int) -> int:
    """Blocks that ``tokens`` tokens fill beyond the ``held`` ones."""
    return max(0, -(-tokens // block_size) - held)


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager keeps for one request, from its first lookup until ``free``."""

    blocks: list[int] = field(default_factory=list)  # its block table, in token order
    hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks' tokens so far
    packed: list[bytes] = field(default_factory=list)  # and those blocks' token ids, packed
    num_cached: int = 0  # leading blocks already offered to the prefix cache


class KVCacheManager:
    """Per-request block tables over one ``BlockPool``, with prefix-cache counters."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool: Pool = make_pool(num_blocks, enable_prefix_caching)
        self.events: list[KVEvent] | None = None  # a list: record index changes into it
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens served from it

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in token order).

        The manager's own list, not a copy: it grows as the request does, and is dropped
        when the request is freed. Read it before the next ``allocate_slots``/``free``.
        """
        record = self._requests.get(request_id)
        return record.blocks if record is not None else []

    def _record(self, request_id: str) -> _RequestBlocks:
        """The request's record, made empty on first use."""
        record = self._requests.get(request_id)
        if record is None:
            record = self._requests[request_id] = _RequestBlocks()
        return record

    def _request_hashes(self, request: Request) -> _RequestBlocks:
        """The request's record, its ``hashes`` (and ``packed``) extended to every full
        block of its known tokens (only the blocks filled since, not the whole history)."""
        record = self._record(request.request_id)
        hashes, bs = record.hashes, self.block_size
        done, full = len(hashes), request.num_tokens // bs
        if full > done:
            parent = hashes[-1] if hashes else None
            new = request.token_ids(done * bs, full * bs)
            hashes += block_hashes(new, bs, request.cache_salt, 0, parent, record.packed)
        return record

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request (blocks, tokens), leaving one token to compute.

        Mutates nothing: the blocks are only taken by a successful ``allocate_slots``.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return [], 0
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        record = self._request_hashes(request)
        hits = self.pool.longest_hit(record.hashes, record.packed, max_blocks)
        return hits, len(hits) * self.block_size

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record one admitted request's prefix-cache query (vLLM counts tokens)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Room for ``num_new_tokens`` beyond what is computed (and hit); ``None`` if it can't fit.

        On success the hit blocks are taken (ref count +1) and appended to the request's
        table, followed by the newly allocated blocks, which are returned.
        """
        record = self._record(request.request_id)
        held, bs = record.blocks, self.block_size
        computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        if not new_computed_blocks and computed + num_new_tokens <= len(held) * bs:
            return []  # most decode steps: the last block still has room
        needed = _blocks_beyond(computed + num_new_tokens, bs, len(held) + len(new_computed_blocks))
        pool = self.pool
        hits_now_free = pool.num_free_of(new_computed_blocks) if new_computed_blocks else 0
        if needed > pool.num_free_blocks - hits_now_free:
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            held += new_computed_blocks
        new = self._take(needed)
        held += new
        return new

    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """The new blocks ``allocate_slots`` would take for ``num_new_tokens`` beyond what
        is computed and ``num_hit_blocks`` prefix-cache hits."""
        bs = self.block_size
        computed = request.num_computed_tokens + num_hit_blocks * bs
        held = len(self.block_ids(request.request_id)) + num_hit_blocks
        return _blocks_beyond(computed + num_new_tokens, bs, held)

    def grow_decodes(self, requests: Sequence[Request]) -> bool:
        """Room for one more token for each of these decoding requests, all or none.

        The ones whose last block is full get a new block each, in this order, as
        ``allocate_slots(request, 1)`` would hand them out one at a time; ``False`` (and
        nothing taken) when fewer blocks are free than that, or one holds no blocks
        or needs more than one block (then ``allocate_slots`` one at a time).
        """
        bs, records = self.block_size, self._requests
        crossing = []
        for request in requests:
            record = records.get(request.request_id)
            room = len(record.blocks) * bs if record is not None else 0
            if not room or request.num_computed_tokens > room:
                return False
            if request.num_computed_tokens == room:
                crossing.append(request.request_id)
        if crossing:
            if len(crossing) > self.pool.num_free_blocks:
                return False
            self.append_blocks(crossing)
        return True

    def append_blocks(self, request_ids: Sequence[str]) -> None:
        """One more block for each of these requests, in this order (decodes crossing into
        a new block, as ``allocate_slots(request, 1)`` would give them one at a time); the
        caller has checked that enough blocks are free."""
        if len(request_ids) > self.pool.num_free_blocks:
            raise RuntimeError(f"{len(request_ids)} blocks asked for, fewer free")
        records = self._requests
        for rid, block in zip(request_ids, self._take(len(request_ids)), strict=True):
            records[rid].blocks.append(block)

    def _take(self, n: int) -> list[int]:
        """``n`` blocks from the pool, which the caller has checked it has."""
        events = self.events
        if events is None:
            new = self.pool.allocate(n)
        else:
            evicted: list[WireHash] = []
            new = self.pool.allocate(n, evicted)
            if evicted:
                events.append(BlockRemoved(evicted))
        assert new is not None
        return new

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's full, computed blocks findable by later requests."""
        num_full = request.num_computed_tokens // self.block_size
        record = self._requests.get(request.request_id)
        start = record.num_cached if record is not None else 0
        if num_full <= start or not self.enable_prefix_caching:
            return  # most decode steps: no block filled up
        record = self._request_hashes(request)
        num_full = min(num_full, len(record.blocks))
        span = slice(start, num_full)
        blocks, hashes, packed = record.blocks[span], record.hashes[span], record.packed[span]
        if self.events is None:
            self.pool.cache_all(blocks, hashes, packed)
        else:
            indexed: list[bool] = []
            self.pool.cache_all(blocks, hashes, packed, indexed)
            parent = record.hashes[start - 1] if start else None
            self.events += stored_runs(hashes, packed, indexed, parent)
        record.num_cached = num_full

    def trim(self, request: Request) -> None:
        """Give back the request's blocks past its computed tokens: those only a speculative
        step's rejected drafts were written to (never cached: only computed full blocks
        are), last block first."""
        record = self._requests.get(request.request_id)
        if record is None:
            return
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(record.blocks) > keep:
            extra = record.blocks[keep:]
            del record.blocks[keep:]
            self.pool.release(extra[::-1])

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks, last block first (its tail is evicted first)."""
        record = self._requests.pop(request.request_id, None)
        if record is not None:
            self.pool.release(record.blocks[::-1])
