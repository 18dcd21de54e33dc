"""What the prefix cache tells the world: a block became findable, blocks were dropped.

The three events are vLLM's (``vllm/distributed/kv_events.py``): ``BlockStored`` when full
blocks enter the prefix index (their chained hashes, the hash of the block before the
first of them, their token ids), ``BlockRemoved`` when an indexed block is taken for new
data and its hash leaves the index, ``AllBlocksCleared`` when the whole index is gone
(a fresh cache). A router that applies them in order knows exactly which prefixes the
replica can serve from cache. The KV cache manager records them while its ``events`` is
a list; the engine hands each step's list to a publisher (``server/kv_events.py``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from sendpath.kvcache.hashing import BlockHash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "WireHash", "stored_runs"]

# A block hash as events carry it: sendpath's are bytes; vLLM's "ExternalBlockHash" may
# also be an int (its older, builtin-hash builds)
WireHash = BlockHash | int


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the index, first to last."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None  # the block before the first one (None: at the start)
    token_ids: list[int]  # every block's tokens, in order: block_size each
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks' hashes left the index (their blocks hold other data now)."""

    block_hashes: list[WireHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The index is empty: whatever was known of this cache is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_runs(
    hashes: Sequence[BlockHash],
    packed: Sequence[bytes],
    indexed: Sequence[bool],
    parent: BlockHash | None,
) -> list[BlockStored]:
    """One ``BlockStored`` per run of consecutive blocks the pool indexed now (``indexed``;
    a block already indexed under its hash, by another request, breaks the run), with
    their hashes and token ids packed as int64 bytes; ``parent``: the hash of the block
    before the first."""
    out: list[BlockStored] = []
    start = 0
    for i, now in enumerate([*indexed, False]):
        if not now:
            if i > start:
                ids = array("q", b"".join(packed[start:i])).tolist()
                out.append(BlockStored(list(hashes[start:i]), parent, ids, len(packed[start]) // 8))
            start = i + 1
            if i < len(hashes):
                parent = hashes[i]
    return out
