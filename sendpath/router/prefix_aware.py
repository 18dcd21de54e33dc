"""Prefix-aware routing: send a request where the start of its prompt is already cached.

Precise, where replicas publish KV events (``--kv-events-config``): the gateway follows
them (``router/kv_index.py``) and a request's match on such a replica is how many of its
prompt's full blocks, hashed from its token ids as the replica hashes them, that replica
holds. Every gateway following the same events agrees.

Approximate, for replicas that publish nothing (llama.cpp, vLLM without events, or a
request whose tokens the gateway could not learn): the gateway cannot see the replicas'
KV caches, so it keeps an approximate copy: for each
replica, the prompts it was sent (and, once answered, prompt + answer: the start of the
conversation's next turn), cut into blocks of ``BLOCK_CHARS`` characters (about one
16-token KV block at 4 characters per token) and stored as chained hashes (a block's hash
covers every block before it, seeded with the tenant's cache salt), which is a prefix tree
flattened into a set. A request's match on a replica is how many of its leading blocks
that replica has seen. Both kinds of match are compared as the fraction of the prompt's
blocks matched, so one fleet can mix the two.

The algorithm (after SGLang's cache-aware router), with its tunables:
1. Imbalance first: if the most and least loaded candidates differ by more than
   ``BALANCE_ABS`` requests *and* the most loaded has more than ``BALANCE_REL`` times the
   least, cache affinity would pile work on one replica: pick the least loaded.
   ``BALANCE_ABS`` is small (SGLang's default is 64, for large GPU batches) because a
   system prompt shared by every conversation matches on the first replica that saw it:
   new conversations go there until the gap opens, and then the next one seeds another
   replica, after which they tie on the match and spread by load.
2. Otherwise, if the best match covers at least ``MATCH_THRESHOLD`` of the prompt's
   blocks, pick the replica with the longest match (ties: the less loaded). Routing it
   there records a guess in the index (``kv_index.GUESS_TTL_S``) until its events come.
3. Otherwise (a new conversation, or a prompt shorter than a block): the least loaded
   (ties: the one with the fewest cached blocks, i.e. the most room).
Each replica remembers at most ``MAX_BLOCKS`` blocks; the least recently used go first,
as in the replica's own LRU free queue. An ejected replica's memory is dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from sendpath.router.kv_index import KVIndex
from sendpath.router.pool import Endpoint
from sendpath.router.route import Prediction, RouteRequest

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

    def __init__(self, index: KVIndex | None = None) -> None:
        self.trees: dict[int, OrderedDict[int, None]] = {}  # the approximate copies
        self.index = index  # what publishing replicas hold (None: the gateway follows none)
        self._chosen_for: tuple[RouteRequest | None, list[int]] = (None, [])  # the last choice

    def match(self, hashes: list[int], endpoint: Endpoint) -> int:
        """How many leading blocks ``endpoint`` has seen (the approximate copy)."""
        tree = self.trees.get(endpoint.index)
        if tree is None:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _block_size(self, request: RouteRequest, endpoint: Endpoint) -> int | None:
        """The replica's block size where the match is precise (it publishes events and
        the request's tokens are known); ``None``: approximate."""
        if self.index is None or request.token_ids is None:
            return None
        return self.index.block_size(endpoint.index)

    def matched(
        self, request: RouteRequest, endpoint: Endpoint, text_hashes: list[int] | None = None
    ) -> tuple[int, int, bool]:
        """(blocks matched, blocks in the prompt, precise) for ``request`` on ``endpoint``
        (``text_hashes``: the request's ``block_hashes``, if already made)."""
        size = self._block_size(request, endpoint)
        if size is not None and self.index is not None:
            hashes = request.token_hashes(size)
            return self.index.match(endpoint.index, hashes), len(hashes), True
        if text_hashes is None:
            text_hashes = block_hashes(request)
        return self.match(text_hashes, endpoint), len(text_hashes), False

    def predicted(self, request: RouteRequest, endpoint: Endpoint) -> Prediction:
        last, hashes = self._chosen_for
        matched, total, precise = self.matched(
            request, endpoint, hashes if last is request else None
        )
        size = self._block_size(request, endpoint) if precise else None
        return Prediction(matched, total, precise, size)

    def choose(self, request: RouteRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        loads = [e.load for e in candidates]
        least = min(candidates, key=lambda e: (e.load, len(self.trees.get(e.index, ()))))
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            return least
        best, best_key = least, (0.0, -least.load)
        text_hashes = block_hashes(request)
        self._chosen_for = (request, text_hashes)  # ``predicted`` asks about it next
        for e in candidates:
            matched, total, _ = self.matched(request, e, text_hashes)
            key = (matched / total if total else 0.0, -e.load)
            if key > best_key:
                best, best_key = e, key
        if best_key[0] > 0 and best_key[0] >= MATCH_THRESHOLD:
            return best
        return least

    def routed(self, request: RouteRequest, endpoint: Endpoint) -> None:
        tree = self.trees.setdefault(endpoint.index, OrderedDict())
        for h in block_hashes(request):
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > MAX_BLOCKS:
            tree.popitem(last=False)
        size = self._block_size(request, endpoint)
        if size is not None and self.index is not None:
            self.index.guess(endpoint.index, request.token_hashes(size))

    def forget(self, endpoint: Endpoint) -> None:
        """The approximate copy goes; the index follows the replica's own events (a
        replica that restarts says so with ``AllBlocksCleared``)."""
        self.trees.pop(endpoint.index, None)
