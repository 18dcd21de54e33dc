"""A request as the router sees it (``RouteRequest``) and what a policy expected of the
replica it chose (``Prediction``): plain data, shared by the policies, the router, the
gateway and the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sendpath.kvcache.hashing import BlockHash, block_hashes

__all__ = ["Prediction", "RouteRequest"]


@dataclass(frozen=True)
class RouteRequest:
    text: str  # the prompt: chat messages as "role\ncontent\n", or the completion prompt
    salt: str | None = None  # the prefix-cache salt the replica gets (per-key isolation)
    chat: bool = True
    token_ids: tuple[int, ...] | None = None  # as the replica tokenizes it, if known
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, compare=False, repr=False)

    def token_hashes(self, block_size: int) -> list[BlockHash]:
        """The chained hashes of the prompt's blocks a replica could serve from cache (its
        full blocks before the last token), as the replica computes them; ``[]`` without
        token ids."""
        found = self._hashes.get(block_size)
        if found is None:
            ids = self.token_ids or ()
            found = self._hashes[block_size] = block_hashes(ids[:-1], block_size, self.salt)
        return found

    def answered(self, answer: str) -> RouteRequest:
        """The prompt followed by its answer: how the conversation's next turn starts."""
        suffix = f"assistant\n{answer}\n" if self.chat else answer
        return RouteRequest(self.text + suffix, self.salt, self.chat)


@dataclass(frozen=True)
class Prediction:
    """What a policy expected of the replica it chose: how much of the prompt it holds
    (``precise``: from that replica's KV events, in its token blocks of ``block_size``;
    else the gateway's guess, in blocks of text)."""

    matched_blocks: int
    prompt_blocks: int
    precise: bool
    block_size: int | None = None  # tokens per block (precise only)

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens expected to come from the replica's cache (precise only)."""
        return self.matched_blocks * self.block_size if self.block_size else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "match": "precise" if self.precise else "approximate",
            "matched_blocks": self.matched_blocks,
            "prompt_blocks": self.prompt_blocks,
            "predicted_cached_tokens": self.cached_tokens,
        }
