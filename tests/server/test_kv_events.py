"""A replica's KV events on real ZMQ sockets, read by a subscriber written against vLLM's
own event structures (``vllm/distributed/kv_events.py``, re-declared here with msgspec as
vLLM declares them): after a chat, ``BlockStored`` holds the prompt's full blocks as
``/tokenize`` gives them, under the hashes a gateway computes; missed batches come back
by sequence number from the replay socket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from sendpath.config import KVEventsConfig
from sendpath.kvcache.event_wire import END_SEQ
from sendpath.kvcache.hashing import block_hashes
from sendpath.model.loader import LoadedModel
from tests.server.conftest import BLOCK, Server, serve

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base class for the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)
WAIT_MS = 10_000  # a socket read that takes longer means the event never came
EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
    topic="kv",
)
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships that sail it. " * 3}]


@pytest.fixture
def published(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny, kv_events=EVENTS) as s:
        yield s


def subscribe(server: Server) -> tuple[zmq.Socket[bytes], dict[str, Any]]:
    """A SUB socket on the replica's announced endpoint (``/load``), and the announcement."""
    announced = httpx.get(server.url + "/load").json()["kv_events"]
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, announced["topic"].encode())
    sub.connect(announced["endpoint"])
    return sub, announced


def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Everything the replay socket sends back for ``start``, up to its end marker."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    dealer.close(linger=0)
    return out


def chat(server: Server, max_tokens: int = 1) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200


def test_load_announces_where_to_subscribe(published: Server) -> None:
    announced = httpx.get(published.url + "/load").json()["kv_events"]
    assert announced["endpoint"].startswith("tcp://127.0.0.1:")
    assert announced["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert announced["topic"] == "kv" and announced["block_size"] == BLOCK


def test_block_stored_holds_the_prompts_full_blocks_under_gateway_hashes(
    published: Server,
) -> None:
    sub, announced = subscribe(published)
    tokens = httpx.post(published.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    full = len(tokens) // BLOCK * BLOCK
    assert full >= 2 * BLOCK
    # the SUB socket may miss what was sent before it joined: the replay socket has it all
    chat(published)  # one output token: only the prompt's blocks fill
    batches = replay(announced["replay_endpoint"], 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert isinstance(batches[0][1].events[0], AllBlocksCleared)  # the cache starts empty
    stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids] == tokens[:full]
    assert [h for e in stored for h in e.block_hashes] == block_hashes(tokens, BLOCK)
    assert stored[0].parent_block_hash is None and {e.block_size for e in stored} == {BLOCK}
    assert {e.medium for e in stored} == {"CPU"}
    # a second chat with the same prompt is a cache hit: nothing new is stored, and the
    # live socket carries the same sequence numbers on as the replay did
    chat(published, max_tokens=BLOCK + 1)  # now its answer fills a block of its own
    topic, seq, payload = sub.recv_multipart()
    while int.from_bytes(seq, "big") < len(batches):  # what the replay already gave
        topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv" and int.from_bytes(seq, "big") == len(batches)
    (event,) = DECODE.decode(payload).events
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == block_hashes(tokens, BLOCK)[-1]
    assert event.token_ids[: len(tokens) - full] == tokens[full:]
    sub.close(linger=0)


def test_replay_starts_at_the_asked_sequence_number(published: Server) -> None:
    announced = httpx.get(published.url + "/load").json()["kv_events"]
    chat(published)
    chat(published, max_tokens=BLOCK + 1)
    everything = replay(announced["replay_endpoint"], 0)
    assert len(everything) == 2  # the first step's (after the opening clear), the answer's
    assert replay(announced["replay_endpoint"], 1) == everything[1:]
    assert replay(announced["replay_endpoint"], len(everything)) == []
