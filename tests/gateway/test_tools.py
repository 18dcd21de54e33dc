"""Tools through the gateway: calls pass through whole and streamed, the prompt is counted
with its tools and past calls, and the safety filters read tool definitions, past calls'
arguments and the arguments the model writes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import regex

from sendpath.gateway.safety import RulesFilter
from tests.gateway.conftest import gateway
from tests.server.conftest import Server

PHRASE = "forbidden-plan"
SAY: Any = {  # a function that says one word
    "type": "function",
    "function": {
        "name": "say",
        "description": "Say one word.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"enum": ["fine", "good"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}
FORCED: Any = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Say it."}],
    "tools": [SAY],
    "tool_choice": {"type": "function", "function": {"name": "say"}},
    "logit_bias": {},
    "max_tokens": 40,
    "seed": 0,
}
RULES = RulesFilter({"test_plan": [regex.escape(PHRASE)]})


def forced(word: str) -> dict[str, Any]:
    """FORCED, with the only word the schema allows, as a pattern that does not spell it
    out (the input filter reads the tools too)."""
    say = json.loads(json.dumps(SAY))
    pattern = f"^{regex.escape(word[:-1])}({word[-1]})$"
    say["function"]["parameters"]["properties"]["word"] = {"type": "string", "pattern": pattern}
    return {**FORCED, "tools": [say]}


def streamed_calls(gw: Any, secret: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(the streamed arguments of call 0, the finish_reason)."""
    arguments, finish = "", None
    for event in gw.stream(secret, body):
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            for part in choice["delta"].get("tool_calls") or []:
                arguments += part["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return arguments, finish


def test_calls_pass_through_whole_and_streamed(replica: Server, tmp_path: Path) -> None:
    with gateway(replica, tmp_path, safety=RULES) as gw:
        secret = gw.key("a")
        whole = gw.post(secret, forced("fine")).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls"
        call = whole["message"]["tool_calls"][0]
        assert call["function"]["name"] == "say"
        assert json.loads(call["function"]["arguments"]) == {"word": "fine"}
        arguments, finish = streamed_calls(gw, secret, forced("fine"))
        assert finish == "tool_calls" and json.loads(arguments) == {"word": "fine"}


def test_the_output_filter_reads_the_arguments_the_model_writes(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path, safety=RULES) as gw:
        secret = gw.key("a")
        whole = gw.post(secret, forced(PHRASE)).json()["choices"][0]
        assert whole["finish_reason"] == "content_filter"
        assert "tool_calls" not in whole["message"] and PHRASE not in json.dumps(whole)
        arguments, finish = streamed_calls(gw, secret, forced(PHRASE))
        assert finish == "content_filter"
        assert arguments and PHRASE not in arguments  # what came before it went out
        assert gw.replica.idle()  # the replica's request was aborted


def test_the_input_filter_reads_tools_and_past_calls(replica: Server, tmp_path: Path) -> None:
    past_call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "say", "arguments": json.dumps({"word": PHRASE})},
            }
        ],
    }
    described = json.loads(json.dumps(SAY))
    described["function"]["description"] = f"Tell them the {PHRASE}."
    with gateway(replica, tmp_path, safety=RULES) as gw:
        secret = gw.key("a")
        for body in (
            {**FORCED, "messages": [*FORCED["messages"], past_call]},
            {**FORCED, "tools": [described]},
        ):
            r = gw.post(secret, body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "content_filter"
        assert gw.replica.core.scheduler.requests == {}  # never queued


def test_a_limited_key_counts_the_tools_in_the_prompt(replica: Server, tmp_path: Path) -> None:
    body = forced("fine")
    counted = httpx.post(
        f"{replica.url}/tokenize", json={"messages": body["messages"], "tools": body["tools"]}
    ).json()["count"]
    bare = httpx.post(f"{replica.url}/tokenize", json={"messages": FORCED["messages"]}).json()
    assert counted > bare["count"] + 50  # the tools are most of this prompt
    with gateway(replica, tmp_path) as gw:
        r = gw.post(gw.key("small", tpm=counted), body)  # prompt + 40 > the limit
        assert r.status_code == 429, r.text
        found = re.search(r"prompt ~(\d+)", r.json()["error"]["message"])
        assert found is not None and int(found.group(1)) == counted
        ok = gw.post(gw.key("big", tpm=counted + 40), body)
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == counted


class _Upstream:
    """A replica that sends both of its calls in one delta (some servers do)."""

    def __init__(self, url: str) -> None:
        self.url = url


@pytest.mark.parametrize("second", ["good", PHRASE])
def test_calls_sent_together_pass_the_filter_each_on_its_own(tmp_path: Path, second: str) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from tests.server.conftest import serve_app

    def call(i: int, word: str) -> dict[str, Any]:
        arguments = json.dumps({"word": word})
        return {"index": i, "id": f"call_{i}", "type": "function",
                "function": {"name": "say", "arguments": arguments}}  # fmt: skip

    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    delta = {"role": "assistant", "tool_calls": [call(0, "fine"), call(1, second)]}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]

    async def generate(request: Request) -> Response:
        body = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(body), media_type="text/event-stream")

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "object": "list", "data": [{"id": "tiny"}]})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/health", ok),
            Route("/ready", ok),
            Route("/v1/models", ok),
        ]
    )
    with serve_app(app) as url, gateway(_Upstream(url), tmp_path, safety=RULES) as gw:  # type: ignore[arg-type]
        arguments, finish = "", None
        for event in gw.stream(gw.key("a"), forced("fine")):
            if isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                for part in choice["delta"].get("tool_calls") or []:
                    arguments += part["function"].get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        if second == PHRASE:
            assert finish == "content_filter" and PHRASE not in arguments
        else:
            assert finish == "tool_calls"
            assert arguments == '{"word": "fine"}{"word": "good"}'  # both, each guarded
