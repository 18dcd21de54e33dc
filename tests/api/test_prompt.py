"""One reading of a request's prompt text: the router's prefix view, the input filter and
the gateway's token estimates all see the same text."""

from __future__ import annotations

import math

from sendpath.api.prompt import message_texts, prompt_text, route_text
from sendpath.api.schema import ChatBody, CompletionBody
from sendpath.gateway.proxy import route_request
from sendpath.gateway.tokens import TEMPLATE_ALLOWANCE, byte_bound, estimate_prompt_tokens

PARTS = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo ☃"}]
CHAT = ChatBody.model_validate(
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": PARTS},
        ],
    }
)


def test_a_chats_text_is_its_messages_parts_joined_with_nothing_a_message_a_line() -> None:
    assert message_texts(CHAT) == ["Be brief.", "Hello ☃"]
    assert prompt_text(CHAT) == "Be brief.\nHello ☃"


def test_the_router_hashes_the_same_texts_each_after_its_role() -> None:
    route = route_request(CHAT, "salt")
    assert route.text == route_text(CHAT) == "system\nBe brief.\nuser\nHello ☃\n"
    assert (route.salt, route.chat) == ("salt", True)
    # the texts between the roles are the input filter's lines
    assert route.text.split("\n")[1::2] == prompt_text(CHAT).split("\n")  # type: ignore[union-attr]


def test_the_token_estimates_read_that_text() -> None:
    text = "Be brief.\nHello ☃"
    assert estimate_prompt_tokens(CHAT) == math.ceil(len(text) / 4) + 4 * 2
    size = len(b"Be brief.") + len("Hello ☃".encode())
    assert byte_bound(CHAT) == size + 16 * 2 + TEMPLATE_ALLOWANCE


def test_a_completion_prompt_reads_the_same_everywhere() -> None:
    for prompt in ("Once upon a time", ["Once upon a time"]):
        request = CompletionBody.model_validate({"model": "m", "prompt": prompt})
        assert prompt_text(request) == "Once upon a time"
        route = route_request(request, None)
        assert (route.text, route.chat) == ("Once upon a time", False)
        assert estimate_prompt_tokens(request) == 4
        assert byte_bound(request) == len("Once upon a time") + 2


def test_token_ids_have_no_text_and_count_exactly() -> None:
    request = CompletionBody.model_validate({"model": "m", "prompt": [5, 17, 3]})
    assert message_texts(request) is None and prompt_text(request) is None
    assert route_request(request, None).text == "5 17 3"
    assert estimate_prompt_tokens(request) == byte_bound(request) == 3


def test_tools_and_past_calls_are_part_of_the_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    tool = {"type": "function", "function": {"name": "f", "description": "Does f."}}
    chat = ChatBody.model_validate(
        {
            "model": "m",
            "tools": [tool],
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ],
        }
    )
    tools = '[{"name": "f", "description": "Does f."}]'
    assert message_texts(chat) == [tools, "Hi", '\nf {"a": 1}', "done"]
    assert route_text(chat) == f'tools\n{tools}\nuser\nHi\nassistant\n\nf {{"a": 1}}\ntool\ndone\n'
    hidden = ChatBody.model_validate({**chat.model_dump(exclude_none=True), "tool_choice": "none"})
    assert message_texts(hidden) == ["Hi", '\nf {"a": 1}', "done"]  # not in the prompt
