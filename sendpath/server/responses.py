"""OpenAI response bodies, stream chunks, usage, logprobs and the ``timings`` object."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sendpath.engine.outputs import EngineOutput
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import Request, TokenLogprobs
from sendpath.server.tool_calls import CallParser, merge
from sendpath.trace import Stage

__all__ = ["Chunker", "LogprobRenderer", "sse", "timings_ms", "usage"]

IMPOSSIBLE = -9999.0  # OpenAI's logprob for a token that cannot come (JSON has no -inf)

_ENGINE_STAGES = (Stage.TOKENIZE, Stage.ENGINE_QUEUE, Stage.PREFILL, Stage.DECODE)  # in path order


def usage(*requests: Request) -> dict[str, Any]:
    """Token counts of an answer; of n answers to one prompt, the prompt once and every
    answer's tokens (as OpenAI counts them)."""
    first = requests[0]
    prompt = first.num_prompt_tokens
    completion = sum(len(r.output_token_ids) for r in requests)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens},
    } | _predictions(requests)


def _predictions(requests: Sequence[Request]) -> dict[str, Any]:
    """Speculative decoding's drafts, as OpenAI counts a predicted output's tokens: those
    kept and those refused (nothing where no draft was proposed)."""
    drafts = sum(r.num_draft_tokens for r in requests)
    if not drafts:
        return {}
    accepted = sum(r.num_accepted_tokens for r in requests)
    return {
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafts - accepted,
        }
    }


def timings_ms(request: Request) -> dict[str, float]:
    """Milliseconds per engine stage, plus ``ttft`` and ``total`` (arrival to finish)."""
    tl = request.timeline
    stages = tl.stages()
    out = {s.value: round(stages[s] * 1000, 3) for s in _ENGINE_STAGES if s in stages}
    if tl.ttft is not None:
        out["ttft"] = round(tl.ttft * 1000, 3)
    if tl.events and tl.end is not None:
        out["total"] = round((tl.end - tl.events[0].time) * 1000, 3)
    return out


class LogprobRenderer:
    """OpenAI's ``logprobs`` objects from the engine's ``TokenLogprobs``: chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and completions' ``{tokens,
    token_logprobs, top_logprobs, text_offset}``. A token's text is its own decoding (a
    token that holds part of a character shows U+FFFD, as OpenAI's do; ``bytes`` are that
    text's UTF-8)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    def chat(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for token_id, lp in zip(ids, logprobs, strict=True):
            entry = self._entry(token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
            content.append(entry)
        return {"content": content}

    def completion(
        self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs], offset: int = 0
    ) -> dict[str, Any]:
        tokens, offsets = [], []
        for token_id in ids:
            tokens.append(self.text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [{self.text(t): _finite(v) for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }


def _finite(logprob: float) -> float:
    return max(logprob, IMPOSSIBLE)


class Chunker:
    """Builds the bodies and SSE chunks of one chat or completion response."""

    def __init__(self, kind: str, response_id: str, model: str, created: int) -> None:
        self.kind, self.id, self.model, self.created = kind, response_id, model, created
        # The per-token event, pre-rendered around its text: the hot path of a stream
        # encodes only the new text (same bytes as sse(self.chunk(text)) with compact JSON).
        head = json.dumps(self._base(True), ensure_ascii=False, separators=(",", ":"))[:-1]
        field = '"delta":{"content":' if kind == "chat" else '"text":'
        close = "}" if kind == "chat" else ""
        self._delta_head = f'data: {head},"choices":[{{"index":'
        self._delta_field = f",{field}"
        self._delta_tail = f'{close},"logprobs":null,"finish_reason":null}}]}}\n\n'

    def delta_sse(self, text: str, index: int = 0) -> str:
        """The SSE event for one text delta of choice ``index``."""
        return (
            f"{self._delta_head}{index}{self._delta_field}"
            f"{json.dumps(text, ensure_ascii=False)}{self._delta_tail}"
        )

    def _base(self, streaming: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """One streamed choice delta (``text=None``: an empty delta, e.g. the finish chunk)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {**self._base(True), "choices": [choice]}

    def delta_chunks(
        self, deltas: list[dict[str, Any]], logprobs: dict[str, Any] | None, index: int = 0
    ) -> list[dict[str, Any]]:
        """Chat chunks of ``deltas`` (a tool-call parser's), the logprobs on the first (or
        on an empty delta, while the parser holds the text they belong to)."""
        if not deltas and logprobs is not None:
            deltas = [{"content": ""}]
        return [
            {
                **self._base(True),
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs if i == 0 else None,
                        "finish_reason": None,
                    }
                ],
            }
            for i, delta in enumerate(deltas)
        ]

    def usage_chunk(self, *requests: Request) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage(*requests)}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str,
        logprobs: dict[str, Any] | None,
        tools: CallParser | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole (non-streamed) response; ``tools`` parses its calls."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tools is not None:
                content, calls = merge(tools.step(text, last=True))
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                finish_reason = tools.finish_reason(finish_reason)
            choice: dict[str, Any] = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return choice

    def body(
        self,
        text: str,
        last: EngineOutput,
        request: Request,
        logprobs: dict[str, Any] | None = None,
        tools: CallParser | None = None,
    ) -> dict[str, Any]:
        """The whole non-streaming response of one choice."""
        choice = self.choice(0, text, str(last.finish_reason), logprobs, tools)
        return self.whole([choice], [request])

    def whole(self, choices: list[dict[str, Any]], requests: list[Request]) -> dict[str, Any]:
        """The whole non-streaming response: its choices, and the requests that made them
        (the first one's timings)."""
        return {
            **self._base(False),
            "choices": choices,
            "usage": usage(*requests),
            "timings": timings_ms(requests[0]),
        }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
