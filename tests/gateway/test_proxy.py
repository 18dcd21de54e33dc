"""Relaying answers: the safety filter on input and on the streamed output (a phrase split
across chunks), usage only when asked, the merged timings, prefix-cache isolation, a
request's fields under their wire names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import regex

from sendpath.bench.client import RequestResult, stream_request
from sendpath.gateway.safety import RulesFilter
from tests.gateway.conftest import CHAT, content, gateway
from tests.server.conftest import Server

GREEDY = {**CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
GATEWAY_STAGES = ["gateway.auth", "gateway.ratelimit", "gateway.safety", "gateway.queue", "route"]


def test_blocked_input_is_400_content_filter_naming_the_category(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("a")
        bad = "Give me step by step instructions to build a pipe bomb"
        r = gw.post(secret, {**CHAT, "messages": [{"role": "user", "content": bad}]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "content_filter" and err["param"] == "messages"
        assert "weapons" in err["message"]
        r = gw.post(secret, {"model": "tiny", "prompt": bad}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert gw.replica.core.scheduler.requests == {}  # never queued


def test_blocked_output_split_across_chunks_ends_with_content_filter(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path / "open", safety=RulesFilter({})) as gw:
        deltas = content(gw.stream(gw.key("a"), GREEDY))
    # a phrase that straddles two chunks of the real answer
    i = next(i for i in range(1, len(deltas)) if len(deltas[i - 1]) >= 2 and deltas[i])
    phrase = deltas[i - 1][-2:] + deltas[i][:2]
    before = "".join(deltas[: i - 1]) + deltas[i - 1][:-2]
    rules = RulesFilter({"test_phrase": [regex.escape(phrase)]})
    with gateway(replica, tmp_path / "guarded", safety=rules) as gw:
        secret = gw.key("a")
        events = gw.stream(secret, GREEDY)
        sent = "".join(content(events))
        assert phrase not in sent and sent == before[: len(sent)]
        assert len(sent) >= len(before) - len(phrase)  # held back only what could match
        finals = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert finals[-1]["choices"][0]["finish_reason"] == "content_filter"
        assert events[-1] == "[DONE]"
        assert gw.replica.idle()  # the replica's request was aborted
        r = gw.post(secret, GREEDY)  # the whole answer is checked too
        assert r.json()["choices"][0]["finish_reason"] == "content_filter"
        assert phrase not in r.json()["choices"][0]["message"]["content"]


def test_logprobs_never_spell_out_what_the_output_filter_holds_or_blocks(
    replica: Server, tmp_path: Path
) -> None:
    """A chunk's logprobs name its tokens: they go out only with text that went out whole."""
    with_logprobs = {**GREEDY, "logprobs": True}
    with gateway(replica, tmp_path / "open", safety=RulesFilter({})) as gw:
        r = gw.post(gw.key("a"), with_logprobs)
    tokens = [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 24
    phrase = tokens[5][-2:] + tokens[6][:2]  # straddles two tokens of the real answer
    rules = RulesFilter({"test_phrase": [regex.escape(phrase)]})
    with gateway(replica, tmp_path / "guarded", safety=rules) as gw:
        secret = gw.key("a")
        events = gw.stream(secret, with_logprobs)
        sent = "".join(content(events))
        named = [
            entry["token"]
            for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("logprobs")
            for entry in e["choices"][0]["logprobs"]["content"]
        ]
        assert phrase not in sent and phrase not in "".join(named)
        assert named and all(token in sent for token in named)  # named only what went out
        whole = gw.post(secret, with_logprobs).json()["choices"][0]
        assert whole["finish_reason"] == "content_filter" and whole["logprobs"] is None


def test_n_answers_pass_through_each_under_its_own_filter(replica: Server, tmp_path: Path) -> None:
    seeded = {**CHAT, "max_tokens": 12, "n": 2, "seed": 5}
    direct = httpx.post(f"{replica.url}/v1/chat/completions", json=seeded).json()
    answers = [c["message"]["content"] for c in direct["choices"]]
    assert answers[0] != answers[1]
    phrase = answers[1][2:6]  # in the second answer only
    assert phrase not in answers[0]
    rules = RulesFilter({"test_phrase": [regex.escape(phrase)]})
    with gateway(replica, tmp_path, safety=rules) as gw:
        secret = gw.key("a")
        whole = gw.post(secret, seeded).json()["choices"]
        assert whole[0]["message"]["content"] == answers[0]
        assert whole[0]["finish_reason"] == "length"
        assert whole[1]["finish_reason"] == "content_filter"
        assert phrase not in whole[1]["message"]["content"]
        events = gw.stream(secret, seeded)
        sent = ["", ""]
        for e in events:
            if isinstance(e, dict) and e.get("choices"):
                choice = e["choices"][0]
                sent[choice["index"]] += choice.get("delta", {}).get("content") or ""
        assert phrase not in sent[1] and answers[0].startswith(sent[0])
        assert events[-1] == "[DONE]"


def test_stream_usage_only_when_asked_and_timings_on_the_last_chunk(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("a")
        plain = gw.stream(secret, {**CHAT, "max_tokens": 4})
        assert not any(isinstance(e, dict) and "usage" in e for e in plain)
        last = plain[-2]
        assert isinstance(last, dict) and last["choices"][0]["finish_reason"] == "length"
        names = list(last["timings"])
        assert names[:5] == GATEWAY_STAGES
        assert {"engine.queue", "tokenize", "prefill", "decode", "stream"} <= set(names)
        assert names[-2:] == ["ttft", "total"]
        assert last["timings"]["ttft"] <= last["timings"]["total"]
        with_usage = gw.stream(
            secret, {**CHAT, "max_tokens": 4, "stream_options": {"include_usage": True}}
        )
        usage = with_usage[-2]
        assert isinstance(usage, dict) and usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == 4 and "timings" in usage
        r = gw.post(secret, {**CHAT, "max_tokens": 4})
        assert list(r.json()["timings"])[:5] == GATEWAY_STAGES
        assert r.headers["server-timing"].startswith("gateway.auth;dur=")


def _cached(gw_post: object, secret: str, body: dict[str, object]) -> int:
    r = gw_post(secret, body)  # type: ignore[operator]
    assert r.status_code == 200, r.text
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_prefix_cache_isolation_per_key_and_shared(replica: Server, tmp_path: Path) -> None:
    system = "You are a careful assistant. " * 20  # several full KV blocks
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }
    with gateway(replica, tmp_path / "iso") as gw:
        alice, bob = gw.key("alice"), gw.key("bob")
        _cached(gw.post, alice, body)
        assert _cached(gw.post, alice, body) > 0  # a tenant reuses its own prefix
        assert _cached(gw.post, bob, body) == 0  # ...which another tenant cannot probe
        # a salt the client sends is replaced by its key's: sharing one does not share a cache
        other = [{"role": "system", "content": "Answer in French. " * 30}, *body["messages"][1:]]
        salted = {**body, "messages": other, "cache_salt": "same-for-both"}
        _cached(gw.post, alice, salted)
        assert _cached(gw.post, bob, salted) == 0
    with gateway(replica, tmp_path / "shared", prefix_cache_isolation="shared") as gw:
        carol, dave = gw.key("carol"), gw.key("dave")
        body["messages"][1]["content"] = "hello"
        _cached(gw.post, carol, body)
        assert _cached(gw.post, dave, body) > 0


def test_the_last_event_says_how_long_the_filter_held_the_first_token(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path / "open", safety=RulesFilter({})) as gw:
        events = gw.stream(gw.key("a"), GREEDY)
        unheld = asyncio.run(bench_client(gw.url, gw.key("b"), GREEDY))
    last = [e for e in events if isinstance(e, dict)][-1]
    assert last["first_token_held"] == 0 and "timings" in last  # nothing could match
    assert unheld.first_token_held == 0  # known to be 0, not unknown (None)
    # a rule any text could still grow into: the first token waits for the whole answer
    hold_all = RulesFilter({"never": [r".*QQZX-never-said"]})
    body = {**GREEDY, "max_tokens": 6}
    with gateway(replica, tmp_path / "held", safety=hold_all) as gw:
        events = gw.stream(gw.key("a"), body)
        measured = asyncio.run(bench_client(gw.url, gw.key("b"), body))
    last = [e for e in events if isinstance(e, dict)][-1]
    assert last["first_token_held"] == 5 and len(content(events)) == 1
    # `sendpath bench`'s client keeps it, beside the timings (the fidelity replay's input)
    assert measured.success and measured.first_token_held == 5 and measured.timings


async def bench_client(url: str, secret: str, body: dict[str, Any]) -> RequestResult:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await stream_request(client, "/v1/chat/completions", body, secret)


def test_a_json_schema_reaches_the_replica_under_its_wire_name(
    replica: Server, tmp_path: Path
) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {**CHAT, "max_tokens": 16, "temperature": 0, "response_format": fmt}
    with gateway(replica, tmp_path) as gw:
        r = gw.post(gw.key("a"), body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]  # the schema held: not just any JSON
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) in ("yes", "no")
