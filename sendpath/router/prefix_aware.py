"""Prefix-aware routing: send a request where the start of its prompt is already cached.

The gateway cannot see the replicas' KV caches, so it keeps an approximate copy: for each
replica, the prompts it was sent (and, once answered, prompt + answer: the start of the
conversation's next turn), cut into blocks of ``BLOCK_CHARS`` characters (about one
16-token KV block at 4 characters per token) and stored as chained hashes (a block's hash
covers every block before it, seeded with the tenant's cache salt), which is a prefix tree
flattened into a set. A request's match on a replica is how many of its leading blocks
that replica has seen.

The algorithm (after SGLang's cache-aware router), with its tunables:
1. Imbalance first: if the most and least loaded candidates differ by more than
   ``BALANCE_ABS`` requests *and* the most loaded has more than ``BALANCE_REL`` times the
   least, cache affinity would pile work on one replica: pick the least loaded.
   ``BALANCE_ABS`` is small (SGLang's default is 64, for large GPU batches) because a
   system prompt shared by every conversation matches on the first replica that saw it:
   new conversations go there until the gap opens, and then the next one seeds another
   replica, after which they tie on the match and spread by load.
2. Otherwise, if the best match covers at least ``MATCH_THRESHOLD`` of the prompt's
   blocks, pick the replica with the longest match (ties: the less loaded).
3. Otherwise (a new conversation, or a prompt shorter than a block): the least loaded
   (ties: the one with the fewest cached blocks, i.e. the most room).
Each replica remembers at most ``MAX_BLOCKS`` blocks; the least recently used go first,
as in the replica's own LRU free queue. An ejected replica's memory is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sendpath.router.policy import RouteRequest
from sendpath.router.pool import Endpoint

__all__ = ["PrefixAware"]

BLOCK_CHARS = 64
MATCH_THRESHOLD = 0.5
BALANCE_ABS = 2
BALANCE_REL = 1.5
MAX_BLOCKS = 1 << 16  # per replica: ~4 M characters, ~1 M tokens of prompts


def block_hashes(request: RouteRequest) -> list[int]:
    """Chained hashes of the prompt's full blocks."""
    text, out = request.text, []
    parent = hash(request.salt or "")
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        parent = hash((parent, text[start : start + BLOCK_CHARS]))
        out.append(parent)
    return out


class PrefixAware:
    """Longest cached prefix when it is long enough and load is balanced; else least load."""

    name = "prefix_aware"

    def __init__(self) -> None:
        self.trees: dict[int, OrderedDict[int, None]] = {}

    def match(self, hashes: list[int], endpoint: Endpoint) -> int:
        """How many leading blocks ``endpoint`` has seen."""
        tree = self.trees.get(endpoint.index)
        if tree is None:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        loads = [e.load for e in candidates]
        least = min(candidates, key=lambda e: (e.load, len(self.trees.get(e.index, ()))))
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            return least
        hashes = block_hashes(request)
        if not hashes:
            return least
        best = max(candidates, key=lambda e: (self.match(hashes, e), -e.load))
        if self.match(hashes, best) >= MATCH_THRESHOLD * len(hashes):
            return best
        return least

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        tree = self.trees.setdefault(endpoint.index, OrderedDict())
        for h in block_hashes(request):
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > MAX_BLOCKS:
            tree.popitem(last=False)

    def forget(self, endpoint: Endpoint) -> None:
        self.trees.pop(endpoint.index, None)
