"""`sendpath chat` against a real gateway: the answer, the trace, network on the client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sendpath.model.loader import LoadedModel
from tests.gateway.conftest import gateway
from tests.server.conftest import Server, serve


@pytest.fixture(scope="module")
def replica(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny) as s:
        yield s


ORDER = [
    "gateway.auth", "gateway.ratelimit", "gateway.safety", "gateway.queue", "route",
    "tokenize", "engine.queue", "prefill", "decode", "stream",
]  # fmt: skip


def chat(url: str, secret: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SENDPATH_API_KEY": secret or ""}
    cmd = [sys.executable, "-m", "sendpath.cli", "chat", "hello", "--url", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_chat_json_has_the_whole_timeline_and_network(replica: Server, tmp_path: Path) -> None:
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("cli")
        res = chat(gw.url, secret, "--max-tokens", "5", "--json")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert [s["stage"] for s in out["stages"]] == [*ORDER, "network"]
        total = out["trace"]["timings"]["total"]
        assert out["network_ms"] == round(out["client"]["e2e_ms"] - total, 3)
        network = out["stages"][-1]  # as the waterfall draws it: half before, half after
        assert network["duration_ms"] == out["network_ms"]
        first, second = network["spans"]
        assert first == [0.0, out["network_ms"] / 2] and second[1] == out["network_ms"] / 2
        assert out["stages"][0]["start_ms"] >= out["network_ms"] / 2
        assert out["network_ms"] > 0  # the client waited longer than the server worked
        assert len(out["trace"]["tokens_ms"]) == out["client"]["output_tokens"] == 5
        drawn = chat(gw.url, secret, "--max-tokens", "5")
        assert drawn.returncode == 0, drawn.stderr
        assert "where the time went" in drawn.stdout
        assert "decode" in drawn.stdout and "network" in drawn.stdout
        denied = chat(gw.url, None, "--max-tokens", "5")
        assert denied.returncode != 0 and "401" in denied.stderr


def test_chat_against_a_server_without_traces(replica: Server) -> None:
    # a bare replica: its timings are laid end to end (its own trace has no stages)
    res = chat(replica.url, None, "--max-tokens", "4", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["trace"] is None and out["network_ms"] > 0
    stages = [s["stage"] for s in out["stages"]]
    assert stages == ["tokenize", "engine.queue", "prefill", "decode", "network"]


def test_the_routing_line_says_why_the_replica_was_chosen() -> None:
    from sendpath.chat import routing_line

    precise = {
        "policy": "prefix_aware", "match": "precise", "matched_blocks": 3, "prompt_blocks": 4,
        "predicted_cached_tokens": 48, "cached_tokens": 48,
        "runs_on": {"engine": "ray", "node": "0123456789abcdef", "host": "gpu-7", "id": "x"},
    }  # fmt: skip
    assert routing_line("replica-1", precise) == (
        "routed to replica-1 by prefix_aware: expected 48 tokens, 3 of 4 prompt blocks cached "
        "(precise); the replica had 48 cached; it runs on gpu-7 (Ray node 0123456789ab)"
    )
    plain = {"policy": "round_robin", "runs_on": None, "cached_tokens": None}
    assert routing_line("replica-0", plain) == "routed to replica-0 by round_robin"
