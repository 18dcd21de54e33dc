"""The relay under the output filter when one read brings several text chunks: judged as
one text, each chunk still goes out as it came, and a phrase among them is still blocked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from sendpath.clock import SettableClock
from sendpath.gateway.attempt import Head
from sendpath.gateway.chunks import SSELines, read_head_events
from sendpath.gateway.context import GatewayContext
from sendpath.gateway.outcome import Outcome
from sendpath.gateway.output_filter import ChoiceFilter
from sendpath.gateway.relay import StreamRelay
from sendpath.gateway.safety import OutputGuard, RulesFilter

RULES = RulesFilter({"spoilers": ["the butler did it"]})
DONE = "data: [DONE]\n\n"
BASE = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}


def chunk(text: str | None = None, finish: str | None = None) -> str:
    delta = {"content": text} if text is not None else {"role": "assistant"}
    choice = {"index": 0, "delta": delta if finish is None else {}, "finish_reason": finish}
    return f"data: {json.dumps({**BASE, 'choices': [choice]})}\n\n"


class Upstream:
    """What the relay asks of the replica's response (``upstream.UpstreamResponse``)."""

    class content:  # its body
        @staticmethod
        def at_eof() -> bool:
            return True

    def release(self) -> None:
        pass


class Router:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def failed(self, endpoint: Any, why: str) -> None:
        self.failures.append(why)

    def answered(self, route: Any, endpoint: Any, text: str) -> None:
        pass


class Endpoint:
    url, name = "http://replica", "replica-0"


def relay(*reads: str) -> list[tuple[str, bool]]:
    """What the client is sent, write by write, for the replica's reads (the head, up to
    the first token, read as the attempt reads it)."""

    async def run() -> list[tuple[str, bool]]:
        async def parts() -> AsyncIterator[bytes]:
            for part in reads:
                yield part.encode()

        lines = SSELines(parts())
        head = Head(await read_head_events(lines), Upstream(), lines, {}, lambda: None)  # type: ignore[arg-type]
        router = Router()
        outcome = Outcome(GatewayContext(SettableClock(), 0.0), router, None, lambda ctx: None)  # type: ignore[arg-type]
        outcome.endpoint = Endpoint()  # type: ignore[assignment]
        r = StreamRelay(outcome, head, ChoiceFilter(lambda: OutputGuard(RULES)), 1, False, 60.0)
        out = [write async for write in r.events()]
        assert router.failures == []
        return out

    return asyncio.run(run())


def texts(write: str) -> list[str | None]:
    """Each event's text in one write (None: no text; "[DONE]")."""
    out: list[str | None] = []
    for line in write.split("\n\n")[:-1]:
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            out.append(payload)
            continue
        delta = json.loads(payload)["choices"][0]["delta"]
        out.append(delta.get("content"))
    return out


def test_a_reads_chunks_go_out_as_they_came_when_their_text_passes() -> None:
    words = ["It was ", "the bu", "s ", "driver."]  # "the bu" could have become the phrase
    sent = relay(chunk() + "".join(map(chunk, words)) + chunk(finish="stop") + DONE)
    assert len(sent) == 1 and sent[0][1] is False  # one write, the last
    expected = [chunk()] + [chunk(w) for w in words]
    assert sent[0][0].startswith("".join(expected))  # byte for byte, not rewritten
    assert texts(sent[0][0]) == [None, *words, None, "[DONE]"]


def test_a_phrase_split_within_one_read_is_blocked_after_what_came_before_it() -> None:
    words = ["Spoiler: ", "the but", "ler did", " it."]
    sent = relay(chunk() + "".join(chunk(w) for w in words) + chunk(finish="stop"))
    body = "".join(write for write, _ in sent)
    assert "butler" not in body and "but" not in body
    assert texts(body) == [None, "Spoiler: ", None, "[DONE]"]  # then the finish
    assert '"finish_reason": "content_filter"' in body.replace('":"', '": "')


def test_text_that_may_still_become_a_phrase_waits_for_the_next_read() -> None:
    first = chunk() + chunk("Then ") + chunk("the bu")
    second = chunk("tler came") + chunk(finish="stop") + DONE
    sent = relay(first, second)
    assert [texts(write) for write, _ in sent] == [
        [None, "Then "],  # "the bu" held back at the end of the first read
        ["the butler came", None, "[DONE]"],
    ]


def test_a_last_token_brings_out_what_is_held_in_its_own_chunk() -> None:
    """A finishing chunk with text, while the filter holds some: what it lets go and what
    it held go out as one chunk (a client counts one chunk a token at most)."""
    choice = {"index": 0, "delta": {"content": "s, the bu"}, "finish_reason": "length"}
    last = f"data: {json.dumps({**BASE, 'choices': [choice]})}\n\n"
    sent = relay(chunk() + chunk("Then ") + chunk("the bu"), last + DONE)
    assert [texts(write) for write, _ in sent] == [
        [None, "Then "],
        ["the bus, the bu", None, "[DONE]"],  # then the finish, held with the others
    ]


def test_text_held_when_a_choice_ends_on_a_tool_call_goes_out() -> None:
    """A choice whose last chunk is a piece of a tool call: the text its filter still held
    (it could have become a phrase) goes out before the call, and the choice finishes
    once."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{}"}}  # fmt: skip
    choice = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}
    last = f"data: {json.dumps({**BASE, 'choices': [choice]})}\n\n"
    sent = relay(chunk() + chunk("Then ") + chunk("the bu"), last + DONE)
    body = "".join(write for write, _ in sent)
    assert texts(body) == [None, "Then ", "the bu", None, None, "[DONE]"]  # the call, finish
    assert body.count('"tool_calls"') == 2  # the call's piece and one finish reason
    assert (
        body.count('"finish_reason": "tool_calls"') + body.count('"finish_reason":"tool_calls"')
        == 1
    )
