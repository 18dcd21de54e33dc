"""What each replica's prefix cache really holds, from its KV events: exact prefix matches.

For every replica that publishes events (``server/kv_events.py``) the index keeps the set
of block hashes in its prefix index: ``BlockStored`` adds, ``BlockRemoved`` takes away,
``AllBlocksCleared`` empties. The hashes are the replica's own (``kvcache/hashing.py``), so
a request's match on a replica is how many of its prompt's leading full blocks, hashed the
same way from its token ids and cache salt, are in that set. Every gateway that follows
the same events has the same index, so they agree on where a prefix lives.

Events arrive a few milliseconds after the replica computes a prompt, so a request routed
now would not be seen by the next one with the same new prefix (a burst of new
conversations sharing a system prompt). As llm-d's precise scorer does, routing a request
records a *guess*: its blocks count as held by the chosen replica for ``GUESS_TTL_S``, or
until events say otherwise. At most ``MAX_BLOCKS`` hashes are kept per replica (the
oldest stored go first), so lost ``BlockRemoved`` events cannot grow it without bound.

Plain state: no I/O and no clock of its own (the router's ``Clock``), so the simulator
can run it too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from sendpath.clock import Clock
from sendpath.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, WireHash

__all__ = ["GUESS_TTL_S", "MAX_BLOCKS", "KVIndex"]

GUESS_TTL_S = 2.0
MAX_BLOCKS = 1 << 20  # per replica: a 16-token block each, 16 M tokens of cache


@dataclass
class _Replica:
    """One publishing replica as its events describe it."""

    block_size: int
    held: OrderedDict[WireHash, None] = field(default_factory=OrderedDict)  # oldest first
    guesses: dict[WireHash, float] = field(default_factory=dict)  # hash -> expires at


class KVIndex:
    """The block hashes each publishing replica holds, by replica index."""

    def __init__(self, clock: Clock, guess_ttl_s: float = GUESS_TTL_S) -> None:
        self.clock, self.guess_ttl_s = clock, guess_ttl_s
        self._replicas: dict[int, _Replica] = {}

    def follow(self, replica: int, block_size: int) -> None:
        """Start following ``replica`` (its cache taken as empty until events say more)."""
        self._replicas[replica] = _Replica(block_size)

    def forget(self, replica: int) -> None:
        """Stop following ``replica`` (it vanished, or publishes no more)."""
        self._replicas.pop(replica, None)

    def block_size(self, replica: int) -> int | None:
        """The replica's block size, if it is followed (``None``: it publishes nothing)."""
        found = self._replicas.get(replica)
        return found.block_size if found is not None else None

    def num_blocks(self, replica: int) -> int:
        """Hashes held by ``replica`` as its events say (guesses left out)."""
        found = self._replicas.get(replica)
        return len(found.held) if found is not None else 0

    def apply(self, replica: int, events: Sequence[KVEvent]) -> None:
        """One batch of the replica's events, in order (ignored if it is not followed)."""
        found = self._replicas.get(replica)
        if found is None:
            return
        held, guesses = found.held, found.guesses
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    held[h] = None
                    held.move_to_end(h)
                    guesses.pop(h, None)
                while len(held) > MAX_BLOCKS:
                    held.popitem(last=False)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.pop(h, None)
                    guesses.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
                guesses.clear()

    def guess(self, replica: int, hashes: Sequence[WireHash]) -> None:
        """A request with these blocks was just routed to ``replica``: count them as held
        there for ``guess_ttl_s``, until its events arrive."""
        found = self._replicas.get(replica)
        if found is None:
            return
        until = self.clock.now() + self.guess_ttl_s
        guesses = found.guesses
        for h in hashes:
            if h not in found.held:
                guesses[h] = until
        if len(guesses) > MAX_BLOCKS:  # a flood of unconfirmed guesses: drop the expired
            now = self.clock.now()
            found.guesses = {h: t for h, t in guesses.items() if t > now}

    def match(self, replica: int, hashes: Sequence[WireHash]) -> int:
        """How many leading blocks of ``hashes`` ``replica`` holds (or is guessed to)."""
        found = self._replicas.get(replica)
        if found is None:
            return 0
        held, guesses, now = found.held, found.guesses, self.clock.now()
        n = 0
        for h in hashes:
            if h not in held and guesses.get(h, 0.0) <= now:
                break
            n += 1
        return n
