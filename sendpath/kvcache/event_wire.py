"""KV events as bytes: vLLM's msgpack ``KVEventBatch``, written and read.

Written in the layout of vLLM's msgspec structs today (``vllm/distributed/kv_events.py``):
the batch a map ``{"ts", "events", "data_parallel_rank"}``, each event a map tagged by
``type`` (``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``lora_id``, ``medium``, ``lora_name``; ``BlockRemoved``:
``block_hashes``, ``medium``; ``AllBlocksCleared``). Read in that layout and in the
older one vLLM used before (``array_like`` structs: the batch ``[ts, events, rank]``, an
event ``["BlockStored", hashes, parent, tokens, block_size, ...]``), so a subscriber
follows either kind of publisher. msgpack is imported on first use (``sendpath[kv-events]``).
"""

from __future__ import annotations

from typing import Any

from sendpath.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, WireHash

__all__ = ["END_SEQ", "WireError", "decode_batch", "encode_batch"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the sequence number that ends a replay


class WireError(ValueError):
    """A payload that is not a KV event batch."""


def _event(event: KVEvent, medium: str) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[KVEvent], medium: str, rank: int = 0) -> bytes:
    """One step's events as a msgpack ``KVEventBatch`` (``medium``: "GPU" or "CPU")."""
    import msgpack

    batch = {"ts": ts, "events": [_event(e, medium) for e in events], "data_parallel_rank": rank}
    packed: bytes = msgpack.packb(batch, use_bin_type=True)
    return packed


def _hashes(raw: Any) -> list[WireHash]:
    if not isinstance(raw, list):
        raise WireError("block_hashes is not a list")
    return raw


def _read_event(raw: Any) -> KVEvent | None:
    """One event of either layout; ``None`` for a kind this reader does not know."""
    if isinstance(raw, dict):
        kind, get = raw.get("type"), raw.get
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
            "BlockRemoved": ("block_hashes",),
        }.get(kind if isinstance(kind, str) else "", ())
        fields = dict(zip(names, raw[1:], strict=False))
        get = fields.get
    else:
        raise WireError("an event is neither a map nor an array")
    if kind == "BlockStored":
        tokens, size = get("token_ids"), get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
            raise WireError("BlockStored needs token_ids and a block_size")
        return BlockStored(_hashes(get("block_hashes")), get("parent_block_hash"), tokens, size)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(get("block_hashes")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A batch's timestamp and its events (kinds this reader does not know are left out);
    raises ``WireError`` for a payload that is not a batch."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise WireError("a batch is neither a map nor an array")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("a batch needs ts and events")
    return float(ts), [e for raw_event in events if (e := _read_event(raw_event)) is not None]
