"""`sendpath bench` against our server and against a stand-in for another OpenAI-compatible
server: the same JSON keys (the stand-in just has no stage breakdown)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from sendpath.cli import main
from sendpath.model.loader import LoadedModel
from tests.gateway.conftest import gateway
from tests.server.conftest import Server, serve, serve_app

VLLM_KEYS = {
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip


@pytest.fixture(scope="module")
def replica(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny) as s:
        yield s


def stand_in() -> FastAPI:
    """A minimal OpenAI-compatible server: fixed words, no usage, no timings."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> AsyncIterator[str]:
            for i in range(body.get("max_tokens") or 4):
                await asyncio.sleep(0.002)
                chunk = {"id": "x", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}  # fmt: skip
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def bench(url: str, out: Path, *args: str) -> dict[str, Any]:
    argv = ["bench", "--url", url, "--num-requests", "6", "--concurrency", "3",
            "--input-len", "16", "--output-len", "5", "--json", str(out), *args]  # fmt: skip
    assert main(argv) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_same_keys_against_ours_and_another_server(
    replica: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with gateway(replica, tmp_path / "gw") as gw:
        ours = bench(gw.url, tmp_path / "ours.json", "--api-key", gw.key("bench"),
                     "--goodput", "ttft:10000", "--plot", str(tmp_path / "stages.png"))  # fmt: skip
    assert set(ours) >= VLLM_KEYS and ours["completed"] == 6 and ours["failed"] == 0
    assert ours["total_output_tokens"] == 30 and ours["request_goodput"] > 0
    assert {"prefill", "decode", "gateway.queue", "network"} <= set(ours["stages"])
    assert sum(v["share"] for v in ours["stages"].values()) == pytest.approx(1.0, abs=0.02)
    assert ours["dominant_stage"] in ("queue", "prefill", "decode", "other")
    assert (tmp_path / "stages.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "TTFT ms" in printed and "where the time went" in printed and "dominated" in printed
    with serve_app(stand_in()) as url:
        other = bench(url, tmp_path / "other.json")
    assert set(other) == set(ours) - {"request_goodput", "dominant_stage"}
    assert other["completed"] == 6 and other["model"] == "stand-in"
    assert other["total_output_tokens"] == 30 and other["stages"] == {}


def test_bad_flags_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--input-len", "x"]) == 2
    assert "length is N or LOW-HIGH" in capsys.readouterr().err
    assert main(["bench", "--goodput", "speed:3", "--model", "m"]) == 2
    assert "--goodput takes NAME:MS" in capsys.readouterr().err
