"""A replica with speculative decoding on (n-gram prompt lookup) over HTTP, beside one
without: the built-in model's greedy answers are the same, streamed or not, and so are
those with stop strings, n, logprobs, penalties and a JSON schema (the last three decode
without drafts); usage counts the drafts kept and refused (OpenAI's prediction-token
fields), /metrics has vLLM's spec_decode counters; a bad ``--speculative-config`` is
refused before anything loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from sendpath.config import CacheConfig, EngineConfig, ReplicaConfig
from sendpath.server.app import create_app
from sendpath.speculative_config import SpeculativeConfig
from tests.server.conftest import serve_app

TEXT = (
    "Tokyo is the capital of Japan. It is one of the largest cities in the world, with "
    "more than thirty million people living in its metropolitan area."
)
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    """(with speculation, without): two replicas of the built-in model. The cache holds
    a whole 8,192-token context in float32 (``--dtype auto`` where the CPU has no
    bfloat16 arithmetic: AVX2, AVX-512 without BF16), so twice that in bfloat16."""
    with ExitStack() as stack:
        urls = []
        for speculative in (SpeculativeConfig(), None):
            engine = EngineConfig(
                cache=CacheConfig(kv_cache_memory_gib=0.5), speculative=speculative
            )
            urls.append(stack.enter_context(serve_app(create_app(ReplicaConfig(engine=engine)))))
        for url in urls:
            deadline = time.monotonic() + 60
            while (ready := httpx.get(f"{url}/ready")).status_code != 200:
                assert ready.json()["status"] == "loading", "the replica failed to load (log)"
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield urls[0], urls[1]


def _chat(url: str, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40, **fields}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_replica_answers_with_drafts_as_without(replicas: tuple[str, str]) -> None:
    fast, plain = replicas
    expected = _chat(plain)["choices"][0]["message"]["content"]
    answer = _chat(fast)
    assert answer["choices"][0]["message"]["content"] == expected
    details = answer["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    assert "completion_tokens_details" not in _chat(plain)["usage"]
    streamed = ""
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
    with httpx.stream(
        "POST", f"{fast}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice["delta"].get("content") or ""
    assert streamed == expected
    metrics = httpx.get(f"{fast}/metrics").text
    kept = _metric(metrics, "sendpath:spec_decode_num_accepted_tokens_total")
    assert kept >= 2 * details["accepted_prediction_tokens"]  # both requests' drafts
    assert _metric(metrics, "sendpath:spec_decode_num_draft_tokens_total") >= kept
    assert 'sendpath:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
    assert "spec_decode" not in httpx.get(f"{plain}/metrics").text


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": ["million"]},
        {"n": 2},
        {"logprobs": True, "top_logprobs": 2},
        {"presence_penalty": 0.5},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "schema": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        },
    ],
    ids=["stop", "n", "logprobs", "penalty", "json_schema"],
)
def test_sampling_fields_answer_with_drafts_as_without(
    replicas: tuple[str, str], fields: dict[str, Any]
) -> None:
    fast, plain = replicas
    got, want = _chat(fast, **fields), _chat(plain, **fields)
    assert got["choices"] == want["choices"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_a_bad_speculative_config_is_refused_with_what_is_wrong() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sendpath.cli", "replica", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 40}'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "num_speculative_tokens must be 1 to 16, got 40" in out.stderr
