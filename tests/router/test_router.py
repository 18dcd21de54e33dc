"""What a replica's /load announces of its KV events, as the router reads it."""

from __future__ import annotations

from typing import Any

import pytest

from sendpath.router.pool import EventSource
from sendpath.router.router import event_source

GOOD = {"endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://0.0.0.0:5558", "topic": "kv"}


def test_a_wildcard_host_is_the_replicas_own() -> None:
    found = event_source({**GOOD, "block_size": 16}, "http://10.1.2.3:8001")
    assert found == EventSource("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv", 16)
    v6 = event_source({**GOOD, "endpoint": "tcp://[::]:7", "block_size": 16}, "http://[fd00::1]:1")
    assert v6 is not None and v6.endpoint == "tcp://[fd00::1]:7"
    local = {"endpoint": "tcp://127.0.0.1:9", "topic": "", "block_size": 32}
    assert event_source(local, "http://127.0.0.1:1") == EventSource(
        "tcp://127.0.0.1:9", None, "", 32
    )


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "tcp://127.0.0.1:1",
        {**GOOD},  # no block size
        {**GOOD, "block_size": True},
        {**GOOD, "block_size": 0},
        {**GOOD, "block_size": 16, "endpoint": "inproc://cache"},  # not across processes
        {**GOOD, "block_size": 16, "endpoint": "tcp://127.0.0.1:*"},  # no port yet
        {**GOOD, "block_size": 16, "topic": 3},
    ],
)
def test_what_cannot_be_followed_is_no_source(raw: Any) -> None:
    assert event_source(raw, "http://127.0.0.1:8001") is None
