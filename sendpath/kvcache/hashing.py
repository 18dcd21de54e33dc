"""Chained block hashes: a full block's hash covers its tokens and every block before it.

``hash(block i) = H(hash(block i-1), token ids of block i, salt)``, so equal hashes mean
equal prefixes (up to a verified collision), and a tenant salt keeps one tenant's cached
prefix invisible to another. Hashes are stable across processes (BLAKE2b, not ``hash()``),
so a router in another process can compute the same ones. ``block_hashes`` runs in C
(``kv_native.c``) where that was built; ``python_block_hashes`` is the reference.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

from sendpath.kvcache.native import kv_native

__all__ = ["BlockHash", "block_hashes", "hash_block", "python_block_hashes"]

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """The hash of one full block given its parent's hash (``None`` for the first block)."""
    h = blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(salt.encode())
    return h.digest()


def python_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
    packed: list[bytes] | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` when ``start > 0``. ``packed``, if
    given, gets each block's token ids as int64 bytes (what the block pool keeps).
    """
    out: list[BlockHash] = []
    end = len(token_ids) // block_size
    if end <= start:
        return out
    # what hash_block feeds BLAKE2b, one block at a time, packed in one go
    data = array("q", token_ids[start * block_size : end * block_size]).tobytes()
    tail, width = salt.encode() if salt else b"", 8 * block_size
    link = parent or b"\0" * 16
    for offset in range(0, len(data), width):
        chunk = data[offset : offset + width]
        link = blake2b(link + chunk + tail, digest_size=16).digest()
        out.append(link)
        if packed is not None:
            packed.append(chunk)
    return out


block_hashes = python_block_hashes
if kv_native is not None:
    block_hashes = kv_native.block_hashes
