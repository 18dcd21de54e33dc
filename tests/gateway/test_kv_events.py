"""Two gateways in front of the same two replicas, conversations alternating between the
gateways: with precise prefix routing (both follow the replicas' KV events) every
follow-up turn lands on the replica holding its conversation, and is served from its
cache, whichever gateway it comes through; with approximate routing the gateway that did
not see a conversation start guesses, and splits them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from sendpath.config import GatewayConfig, KVEventsConfig
from sendpath.gateway.app import create_gateway_app
from sendpath.gateway.keys import KeyStore
from sendpath.gateway.parts import GatewayParts
from sendpath.model.loader import LoadedModel
from sendpath.server.kv_events import KVEventPublisher
from tests.conftest import wait_for
from tests.server.conftest import BLOCK, Server, serve, serve_app

EVENTS = KVEventsConfig(
    enable_kv_cache_events=True,
    endpoint="tcp://127.0.0.1:*",
    replay_endpoint="tcp://127.0.0.1:*",
)
TOPICS = ["the sea", "mountains", "old clocks", "bread", "comets", "violins"]


@contextmanager
def fleet(
    tiny: LoadedModel, data_dir: Path, prefix_routing: str
) -> Iterator[tuple[list[Server], list[tuple[str, GatewayParts]]]]:
    """Two replicas publishing KV events and two gateways in front of both."""
    with ExitStack() as stack:
        replicas = [stack.enter_context(serve(tiny, kv_events=EVENTS)) for _ in range(2)]
        config = GatewayConfig(
            replicas=tuple(r.url for r in replicas),
            data_dir=str(data_dir),
            prefix_routing=prefix_routing,
            health_interval_s=0.1,
        )
        gateways = []
        for _ in range(2):
            app = create_gateway_app(config)
            gateways.append((stack.enter_context(serve_app(app)), app.state.parts))
        yield replicas, gateways


def caught_up(replicas: list[Server], parts: GatewayParts) -> bool:
    """The gateway has applied every batch both replicas have sent."""
    follower = parts.follower
    if follower is None:
        return True
    for i, replica in enumerate(replicas):
        publisher = replica.replica.kv_events
        assert isinstance(publisher, KVEventPublisher)
        if follower.applied.get(i, -1) != publisher.sent - 1:
            return False
    return True


def converse(
    replicas: list[Server], gateways: list[tuple[str, GatewayParts]], secret: str
) -> list[tuple[str, str, int, int, dict[str, Any]]]:
    """Each conversation's turns, alternating gateways: (first replica, this turn's
    replica, cached tokens, the previous turn's prompt tokens, the trace's routing: why
    the gateway chose it) for every follow-up turn."""
    headers = {"Authorization": f"Bearer {secret}"}
    conversations: list[list[dict[str, Any]]] = [
        [  # each its own from the first block on (no default system prompt to share)
            {"role": "system", "content": f"You tell stories about {t}."},
            {"role": "user", "content": f"Tell me a long and careful story about {t}. " * 4},
        ]
        for t in TOPICS
    ]
    first: dict[int, str] = {}
    before: dict[int, int] = {}  # the last turn's prompt tokens
    out = []
    for turn in range(3):
        for c, messages in enumerate(conversations):
            url, parts = gateways[(c + turn) % 2]
            wait_for(lambda parts=parts: caught_up(replicas, parts))  # type: ignore[misc]
            # the last turn is over on every replica, as this gateway sees them: a load
            # still counted (or reported before it ended) would decide a guess instead
            wait_for(lambda parts=parts: all(e.load == 0 for e in parts.pool.endpoints))  # type: ignore[misc]
            body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True}
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            replica = r.headers["x-sendpath-replica"]
            usage = r.json()["usage"]
            if turn == 0:
                first[c] = replica
            else:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                trace = httpx.get(f"{url}/v1/traces/{r.json()['id']}", headers=headers).json()
                out.append((first[c], replica, cached, before[c], trace["routing"]))
            before[c] = usage["prompt_tokens"]
            answer = r.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Go on."},
            ]
    return out


def test_precise_routing_keeps_each_conversation_on_its_replica_from_either_gateway(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    secret = KeyStore(tmp_path).create("alice")[1]
    with fleet(tiny, tmp_path, "precise") as (replicas, gateways):
        wait_for(lambda: all(p.follower and p.follower.following == {0, 1} for _, p in gateways))
        turns = converse(replicas, gateways, secret)
        for url, parts in gateways:  # the operator's view: exactly what each replica holds
            wait_for(lambda parts=parts: caught_up(replicas, parts))  # type: ignore[misc]
            views = httpx.get(url + "/fleet").json()["replicas"]
            for view, server in zip(views, replicas, strict=True):
                cached = server.core.scheduler.kv.pool.num_cached_blocks
                assert view["prefix_routing"]["mode"] == "precise"
                assert view["prefix_routing"]["blocks_held"] == cached > 0
    assert {first for first, *_ in turns} == {"replica-0", "replica-1"}  # both serve
    for first, replica, cached, before, routing in turns:
        assert replica == first
        assert cached >= before // BLOCK * BLOCK - BLOCK  # the last turn's prompt, cached
        # the trace says why: what the events said the replica held, and it did
        assert routing["policy"] == "prefix_aware" and routing["match"] == "precise"
        assert routing["predicted_cached_tokens"] == routing["cached_tokens"] == cached


def test_approximate_routing_splits_conversations_between_gateways(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    secret = KeyStore(tmp_path).create("alice")[1]
    with fleet(tiny, tmp_path, "approximate") as (replicas, gateways):
        assert all(p.follower is None for _, p in gateways)
        turns = converse(replicas, gateways, secret)
        views = httpx.get(gateways[0][0] + "/fleet").json()["replicas"]
        assert [v["prefix_routing"] for v in views] == [{"mode": "approximate"}] * 2
    assert {t[4]["match"] for t in turns} == {"approximate"}  # a guess: no tokens to predict
    assert {t[4]["predicted_cached_tokens"] for t in turns} == {None}
    moved = [t for t in turns if t[1] != t[0]]
    assert moved, "the gateway that did not see a conversation start guessed right every time"
