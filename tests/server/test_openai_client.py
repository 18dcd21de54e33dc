"""The replica through the official openai client: shapes, usage, finish reasons, timings."""

from __future__ import annotations

import asyncio

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from sendpath.engine.core import EngineCore
from tests.server.conftest import Server

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Say something about the sea."}
]
TIMING_KEYS = {"engine.queue", "tokenize", "prefill", "decode", "ttft", "total"}


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def prompt_len(core: EngineCore) -> int:
    return len(core.tokenizer.encode_chat(MESSAGES))


def test_chat_non_streaming(server: Server) -> None:
    resp = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=7,
        extra_body={"ignore_eos": True},
        temperature=0.0,
    )
    assert resp.object == "chat.completion" and resp.model == "tiny"
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == prompt_len(server.core)
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    timings = (resp.model_extra or {})["timings"]
    assert set(timings) == TIMING_KEYS
    assert all(v >= 0 for v in timings.values())
    assert timings["total"] >= timings["ttft"] >= timings["prefill"]


def test_server_timing_header_and_request_id(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3},
    )
    assert r.status_code == 200
    header = r.headers["server-timing"]
    names = [part.split(";")[0].strip() for part in header.split(",")]
    assert set(names) == TIMING_KEYS and "dur=" in header
    assert r.headers["x-request-id"] == r.json()["id"]


def test_chat_streaming_with_usage(server: Server) -> None:
    c = client(server)
    full = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0
    )
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
        )
    )
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert set((last.model_extra or {})["timings"]) == TIMING_KEYS


def test_stream_without_usage_puts_timings_in_the_finish_chunk(server: Server) -> None:
    chunks = list(
        client(server).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, stream=True, temperature=0.0
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert set((chunks[-1].model_extra or {})["timings"]) == TIMING_KEYS
    assert all(ch.usage is None for ch in chunks)


def test_completions_sync_and_async(server: Server) -> None:
    resp = client(server).completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=5,
        extra_body={"ignore_eos": True},
        temperature=0.0,
    )
    assert resp.object == "text_completion" and resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5

    async def stream() -> str:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = await ac.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
            temperature=0.0,
        )
        return "".join([ch.choices[0].text async for ch in out if ch.choices])

    assert asyncio.run(stream()) == resp.choices[0].text


def test_async_chat_concurrent(server: Server) -> None:
    async def main() -> list[str | None]:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        calls = [
            ac.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0
            )
            for _ in range(4)
        ]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    answers = asyncio.run(main())
    assert len(set(answers)) == 1  # greedy, batched together: the same answer


def test_prefix_cache_hits_are_reported(server: Server) -> None:
    long: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "A long shared system of rules. " * 20}
    ]
    c = client(server)
    c.chat.completions.create(model="tiny", messages=long, max_tokens=1)
    again = c.chat.completions.create(model="tiny", messages=long, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= again.usage.prompt_tokens - 16


def test_models_health_load(server: Server) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    load = httpx.get(f"{server.url}/load").json()
    assert set(load) == {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "precision",
        "kv_events",
        "kv_events_sent",
    }
    assert (
        load["kv_events"] is None and load["kv_events_sent"] == 0
    )  # publishes none unless --kv-events-config asks
    assert load["precision"]["dtype"] == "float32"  # the tiny test model's, as asked
    # its float32 weights are not block-quantized, so no matrix engine multiplies them
    assert load["precision"]["matrix_engine"] == "none: no block-quantized weights"
    assert load["precision"]["kv_cache_dtype"] == "float32"  # --kv-cache-dtype auto: the model's
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'matrix_engine="none: no block-quantized weights"' in metrics
    assert "sendpath:engine_info{" in metrics
