"""KV event batches as bytes: what sendpath writes reads back, and vLLM's older layout
(array-like structs) reads as well."""

from __future__ import annotations

import msgpack
import pytest

from sendpath.kvcache.event_wire import WireError, decode_batch, encode_batch
from sendpath.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

EVENTS: list[KVEvent] = [
    AllBlocksCleared(),
    BlockStored([b"a" * 16, b"b" * 16], None, [1, 2, 3, 4], 2),
    BlockRemoved([b"a" * 16]),
]


def test_a_written_batch_reads_back() -> None:
    assert decode_batch(encode_batch(12.5, EVENTS, "CPU")) == (12.5, EVENTS)


def test_the_array_layout_of_older_vllm_reads_too() -> None:
    payload = msgpack.packb(
        [
            3.0,
            [
                ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
                ["SomethingNew", 1],  # a kind from a later version: left out
            ],
            0,
        ]
    )
    ts, events = decode_batch(payload)
    assert ts == 3.0
    assert events == [
        BlockStored([7, 8], 6, [1, 2, 3, 4], 2),
        BlockRemoved([7]),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb("a string"),
        msgpack.packb({"ts": "soon", "events": []}),
        msgpack.packb({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": []}]}),
        msgpack.packb({"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": 3}]}),
        msgpack.packb({"ts": 1.0, "events": [5]}),
    ],
)
def test_what_is_not_a_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)
