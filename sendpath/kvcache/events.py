"""What the prefix cache tells the world: a block became findable, blocks were dropped.

The three events are vLLM's (``vllm/distributed/kv_events.py``): ``BlockStored`` when full
blocks enter the prefix index (their chained hashes, the hash of the block before the
first of them, their token ids), ``BlockRemoved`` when an indexed block is taken for new
data and its hash leaves the index, ``AllBlocksCleared`` when the whole index is gone
(a fresh cache). A router that applies them in order knows exactly which prefixes the
replica can serve from cache. The block pool records them while ``BlockPool.events`` is a
list; the engine hands each step's list to a publisher (``server/kv_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sendpath.kvcache.hashing import BlockHash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "WireHash"]

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
