"""vLLM's ``/tokenize`` and ``/detokenize`` on the replica: what a gateway asks of a
prompt's tokens (``gateway/tokens.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from sendpath.api.json_body import load_json, read_body
from sendpath.api.schema import DetokenizeBody, TokenizeBody, validate
from sendpath.errors import InvalidRequestError, ModelNotFoundError
from sendpath.server.routes_status import replica_of
from sendpath.server.tools import chat_messages, template_tools

__all__ = ["router"]

router = APIRouter()


async def _tokens_body(request: Request, schema: type[TokenizeBody | DetokenizeBody]) -> Any:
    """A /tokenize or /detokenize body, checked, for this replica's model."""
    replica = replica_of(request)
    body = validate(schema, load_json(await read_body(request, replica.config.max_body_bytes)))
    if body.model is not None and body.model != replica.model_name:
        raise ModelNotFoundError(body.model, replica.model_name)
    return body


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """A prompt, or a chat's messages through the chat template, to token ids (vLLM's
    endpoint): how a gateway counts a prompt exactly before reserving it."""
    engine = replica_of(request).ready_engine()
    body: TokenizeBody = await _tokens_body(request, TokenizeBody)
    tokenizer = engine.core.tokenizer
    if body.messages is not None:
        messages = chat_messages(body.messages)  # with their tools, as a chat renders them
        tools = template_tools(body.tools) if body.tools else None
        ids = await asyncio.to_thread(tokenizer.encode_chat, messages, True, tools)
    elif body.prompt is not None:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    else:
        raise InvalidRequestError("Send 'prompt' or 'messages'.", param="prompt")
    return {"count": len(ids), "max_model_len": engine.core.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """Token ids to text (vLLM's endpoint): what a gateway's input filter reads of a
    token-id prompt. Ids outside the vocabulary are refused (400)."""
    engine = replica_of(request).ready_engine()
    body: DetokenizeBody = await _tokens_body(request, DetokenizeBody)
    tokenizer = engine.core.tokenizer
    vocab = tokenizer.vocab_size
    if bad := [t for t in body.tokens if t >= vocab]:
        raise InvalidRequestError(
            f"Token id {bad[0]} is outside this model's vocabulary (0 to {vocab - 1}).",
            param="tokens",
        )
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)  # specials too
    return {"prompt": text}
