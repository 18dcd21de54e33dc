"""Every client mistake gets OpenAI's error shape, the right status, and never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MAX_LEN, Server

OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def with_(**changes: Any) -> bytes:
    body = {**OK, **changes}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


CASES: list[tuple[str, bytes, int, str | None, str]] = [
    ("malformed json", b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    (
        "non-utf8",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        None,
        "UTF-8",
    ),
    ("wrong type: temperature", with_(temperature="hot"), 400, "temperature", "Invalid value"),
    ("wrong type: messages", with_(messages="hello"), 400, "messages", "Invalid value"),
    (
        "wrong type: content",
        with_(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
        "Invalid",
    ),
    ("missing messages", with_(messages=...), 400, "messages", "Missing required parameter"),
    ("missing model", with_(model=...), 400, "model", "Missing required parameter"),
    ("empty messages", with_(messages=[]), 400, "messages", "must not be empty"),
    (
        "unknown role",
        with_(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages.0.role",
        "wizard",
    ),
    ("n > 128", with_(n=129), 400, "n", "less than or equal to 128"),
    ("temperature < 0", with_(temperature=-0.5), 400, "temperature", "greater than or equal"),
    ("temperature > 2", with_(temperature=2.5), 400, "temperature", "less than or equal to 2"),
    ("top_p = 0", with_(top_p=0.0), 400, "top_p", "greater than 0"),
    ("top_p > 1", with_(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("max_tokens < 1", with_(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (
        "max_tokens beyond context",
        with_(max_tokens=MAX_LEN),
        400,
        "max_tokens",
        "context window is 2048",
    ),
    ("penalty out of range", with_(presence_penalty=2.5), 400, "presence_penalty", "less than"),
    ("repetition_penalty 1e-300", with_(repetition_penalty=1e-300), 400, "repetition_penalty",
     "greater"),
    ("min_p > 1", with_(min_p=1.5), 400, "min_p", "less than or equal to 1"),
    ("min_tokens > max_tokens", with_(min_tokens=9, max_tokens=3), 400, "min_tokens", "from 0"),
    ("logit_bias key", with_(logit_bias={"a": 1}), 400, "logit_bias.a", "pattern"),
    ("logit_bias value", with_(logit_bias={"5": 101}), 400, "logit_bias", "less than"),
    ("logit_bias vocab", with_(logit_bias={"999999": 1}), 400, "logit_bias", "vocabulary"),
    ("top_logprobs alone", with_(top_logprobs=3), 400, "top_logprobs", "logprobs: true"),
    ("top_logprobs > 20", with_(logprobs=True, top_logprobs=21), 400, "top_logprobs", "20"),
    ("tool_choice without tools", with_(tool_choice="required"), 400, "tool_choice",
     "needs tools"),
    ("tool_calls", with_(messages=[{"role": "assistant", "tool_calls": [{"id": "1"}]}]), 400,
     "messages.0.tool_calls.0.function", "Missing"),
    ("seed out of range", with_(seed=2**70), 400, "seed", "less than 18446744073709551616"),
    ("wrong type: stream", with_(stream="yes"), 400, "stream", "Invalid value"),
    ("NaN", with_(temperature=...)[:-1] + b', "temperature": NaN}', 400, None, "NaN"),
    ("Infinity", with_(top_p=...)[:-1] + b', "top_p": -Infinity}', 400, None, "-Infinity"),
    ("overflowing float", with_(temperature=...)[:-1] + b', "temperature": 1e400}', 400, None,
     "too large"),
    ("a 5,000-digit int", with_(seed=...)[:-1] + b', "seed": ' + b"9" * 5000 + b"}", 400, None,
     "too long"),
    ("nested 10,000 deep", with_(x=...)[:-1] + b', "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
     400, None, "nests 10001 levels"),
    ("17 stop strings", with_(stop=["x"] * 17), 400, "stop", "at most 16 items"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "text"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_chat_requests(
    server: Server, name: str, body: bytes, status: int, param: str | None, text: str
) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert text in err["message"]


def test_unknown_model_is_404(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=with_(model="gpt-9"))
    assert r.status_code == 404
    assert (
        r.json()["error"]["code"] == "model_not_found" and "'tiny'" in r.json()["error"]["message"]
    )


def test_prompt_longer_than_context_says_both_numbers(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [7] * 3000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "3000 tokens" in err["message"] and "2048 tokens" in err["message"]


def test_body_over_the_limit_is_413(server: Server) -> None:
    big = with_(messages=[{"role": "user", "content": "x" * 70_000}])
    r = httpx.post(f"{server.url}/v1/chat/completions", content=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_completion_prompt_mistakes(server: Server) -> None:
    vocab = server.core.tokenizer.vocab_size
    for prompt, text in [
        ("", "must not be empty"),
        (["a", "b"], "at most 1 item"),
        (3, "Invalid value"),
        ([5, -1], "greater than or equal to 0"),
        ([5, 2**64], "less than 2147483648"),
        ([5, vocab], f"token id {vocab}, outside this model's vocabulary"),
    ]:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": prompt})
        assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
    assert server.idle()


def test_tiny_temperatures_are_greedy(server: Server) -> None:
    """Dividing logits by 1e-300 would make them NaN: such a request samples greedily."""
    answers = []
    for temperature in (0.0, 1e-300, 5e-324, 9e-6):
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**OK, "temperature": temperature, "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert len(set(answers)) == 1
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
