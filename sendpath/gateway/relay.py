"""Relaying one replica's stream to the client, once its first token exists.

Events go on as they arrive: what one network read from the replica brought becomes one
write to the client (a token at a time when the replica streams them one by one; a burst
in one write when several are already there; the last write also ends the body).

Text goes through the output filter (``output_filter.ChoiceFilter``, the one a whole
answer goes through), which holds back only what could still become a blocked phrase.
Each choice of an ``n > 1`` answer has its own guard (their chunks interleave; a phrase
is looked for within one choice), and so has each tool call's arguments (the piece that
names the function goes on at once). A blocked choice finishes with ``content_filter``
and the rest of it is dropped; the others go on, as in a whole answer. Once every choice
is blocked the stream ends (the replica is disconnected, which aborts the request there).
Several text chunks of a one-choice answer that one read brought are judged as one text
(one check instead of one per token; they go out in one write anyway), unless that text
would be blocked: then chunk by chunk, so what came before the phrase still goes out. The
finish and usage chunks are held until the end, so the last event can carry the stitched
``timings`` and, under the output filter, ``first_token_held``: how many more text chunks
(tokens, nearly always) the first one waited for before it could go out. The usage chunk
reaches the client only if it asked for it.

A replica that sends nothing for ``between_tokens_s``, closes early or sends an error
event ends the stream with an explicit SSE error event and no ``[DONE]``; the client is
told which replica (by name) and why, in words that name no internal address.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from sendpath.api.errors import error_body
from sendpath.api.sse import data_of, event
from sendpath.errors import ServiceUnavailableError
from sendpath.gateway.attempt import Head
from sendpath.gateway.chunks import (
    Event,
    arguments_chunk,
    call_part,
    event_of,
    finished,
    index_of,
    text_of,
    tool_calls_of,
    with_arguments,
    with_text,
)
from sendpath.gateway.outcome import Outcome
from sendpath.gateway.output_filter import ChoiceFilter
from sendpath.gateway.upstream import UpstreamConnectionError
from sendpath.gateway.verdict import Verdict, event_status, verdict

__all__ = ["StreamRelay"]

logger = logging.getLogger("sendpath.gateway")

DRAIN_S = 0.5  # after [DONE], how long the end of the replica's HTTP body may take


@dataclass
class StreamRelay:
    """One stream's relay; ``events()`` is the body the client reads."""

    outcome: Outcome  # where what the stream brings is recorded
    head: Head  # the attempt's, up to the first token
    filter: ChoiceFilter | None  # None: no output filter
    choices: int  # how many the answer has (``n``)
    wants_usage: bool
    between_tokens_s: float

    def __post_init__(self) -> None:
        self.ctx = self.outcome.ctx
        self.upstream, self.lines = self.head.upstream, self.head.lines
        self.tail: list[dict[str, Any]] = []  # the finish and usage chunks, held for timings
        self.planned: deque[str] = deque()  # a read's text chunks' parts (``_plan``)
        self.done = False  # the replica sent [DONE]
        self.finished = False  # the answer ended (done or blocked): ``_recorded`` records it

    @property
    def name(self) -> str:
        endpoint = self.outcome.endpoint
        return endpoint.name if endpoint is not None else "the replica"

    async def events(self) -> AsyncGenerator[tuple[str, bool], None]:
        """The client's body: what each network read from the replica brought, as one
        write, with whether more follows (``False``: the last, which ends the body)."""
        why = "the replica closed the stream before [DONE]"
        out: list[str] = []
        try:
            async for events, bad in self._batches():
                if self.filter is not None:
                    self._plan(events)
                for payload, chunk in events:
                    if self._on_event(payload, chunk, out):
                        last = "".join(out)
                        out.clear()
                        try:
                            yield last, False
                        finally:  # once it is written: the answer does not wait for this
                            if self.finished:
                                self.outcome.recorded(whole=self.done)
                        # the whole answer: its connection can be reused once the
                        # end of the body is read (nearly always it came with [DONE])
                        if self.done and not self.upstream.content.at_eof():
                            await self.lines.drain(DRAIN_S)
                        return
                if bad is not None:  # after what came before it
                    raise bad
                if out:
                    yield "".join(out), True
                    out.clear()
        except TimeoutError:
            why = f"it sent nothing for {self.between_tokens_s:g} s"
        except UpstreamConnectionError as exc:
            why = f"the connection failed ({type(exc).__name__})"
        except ValueError:
            why = "it sent an event that is not JSON"
        finally:
            self.upstream.release()  # to the pool if read whole, else closed (aborts it there)
            self.head.release()
        logger.warning("%s broke a stream: %s", self.name, why)
        self.outcome.cut("stream_broken", why)
        # what came before the break, then why
        yield "".join(out) + event(self._broken(why)), False

    async def _batches(self) -> AsyncIterator[tuple[list[Event], ValueError | None]]:
        """The head with the rest of the read that brought its first token, then the
        events of each further read, each within ``between_tokens_s`` (``_read``)."""
        events, bad = self._read(self.lines.received())
        yield self.head.events + events, bad
        while True:
            async with asyncio.timeout(self.between_tokens_s):
                lines = await self.lines.batch()
            if not lines:
                return
            yield self._read(lines)

    @staticmethod
    def _read(lines: list[str]) -> tuple[list[Event], ValueError | None]:
        """The events of one read's lines, up to one that is not JSON (returned, to be
        raised once those before it are sent)."""
        events: list[Event] = []
        bad = None
        for line in lines:
            payload = data_of(line)
            if payload is None:
                continue
            try:
                events.append(event_of(payload))
            except ValueError as exc:
                bad = exc
                break
        return events, bad

    def _plan(self, events: list[Event]) -> None:
        """One guard's work for a read's text chunks: when everything up to the read's end
        (or ``[DONE]``, or an error event) is one answer's plain text chunks (no other
        choice, no tool calls), its guard judges their text once (``ChoiceFilter.texts``)
        and each chunk takes its part. Else, or when the text would be blocked, each
        chunk is pushed on its own. The chunks go out in one write either way."""
        texts: list[str] = []
        for _, chunk in events:
            if chunk is None or "error" in chunk:
                break
            choices = chunk.get("choices") or []
            if not choices:
                continue
            choice = choices[0]
            if len(choices) > 1 or choice.get("index", 0) != 0 or tool_calls_of(choice) is not None:
                return
            text = text_of(choice)
            if text:
                texts.append(text)
        if len(texts) > 1 and self.filter is not None and 0 not in self.filter.blocked:
            self.planned.extend(self.filter.texts(0, texts) or ())

    def _on_event(self, payload: str, chunk: dict[str, Any] | None, out: list[str]) -> bool:
        """Add what one upstream event becomes to ``out``; ``True``: the stream ends."""
        if chunk is None:  # [DONE]
            self.done = True
            out.extend(self._finish())
            return True
        if "error" in chunk:  # the replica's own error event: pass it on, no [DONE]
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            code = error.get("code")
            # too late to retry: whatever is not the request's own fault counts against it
            code = code if isinstance(code, str) else None
            final = verdict(event_status(error), code) is Verdict.FINAL
            self.outcome.cut(code or "error_event", None if final else "an error event mid-stream")
            out.append(event(chunk))
            return True
        timings = self.outcome.noted(chunk)
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: held for the end
            self.tail.append(chunk)
            return False
        sent = self._on_choice(chunk, choices[0])
        for c in sent:  # a chunk that goes on unchanged goes as it came (not re-encoded)
            out.append(f"data: {payload}\n\n" if c is chunk and timings is None else event(c))
        if self.filter is not None and len(self.filter.blocked) >= self.choices:
            out.extend(self._finish())  # every choice blocked: nothing more to wait for
            return True
        return False

    def _on_choice(self, chunk: dict[str, Any], choice: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to send for one with a choice; its finish is held in the tail."""
        index = index_of(choice)
        if self.filter is not None and index in self.filter.blocked:
            return []  # the rest of a blocked choice
        calls = tool_calls_of(choice)
        if calls is not None:
            if len(calls) > 1:
                return self._one_call_at_a_time(chunk, choice, calls)
            call = call_part(choice)
            if call is not None:
                return self._on_call(chunk, choice, *call)
        text, reason = text_of(choice), choice.get("finish_reason")
        judge = self.filter
        out: list[dict[str, Any]] = []
        if text:
            self.outcome.generated(index, text)
            released = self._release(judge, index, text) if judge is not None else text
            if judge is not None and index in judge.blocked:
                return self._block(chunk, released)
            if reason is not None and judge is not None:
                released += judge.rest(index)  # the last token brings what is held, as one
            if released == text and reason is None:
                out.append(chunk)
            elif released:
                out.append(with_text(chunk, released))
        if reason is not None:
            rest = judge.rest(index) if judge is not None and not text else ""
            if rest:
                out.append(with_text(chunk, rest))
            out += self._flush_calls(chunk, index)
            self.tail.append(finished(chunk, reason) if text else chunk)
        elif not text:
            out.append(chunk)  # the role chunk
        self._mark_relayed(out, judge is not None)
        return out

    def _release(self, judge: ChoiceFilter, index: int, text: str) -> str:
        """What goes out of ``text`` now: its part of the read's plan, else ``text``."""
        return self.planned.popleft() if self.planned else judge.text(index, text)

    def _on_call(
        self, chunk: dict[str, Any], choice: dict[str, Any], call: int, arguments: str
    ) -> list[dict[str, Any]]:
        """A piece of a tool call: its arguments go through their own guard (a phrase
        is looked for within one call); the piece that names the function goes on even
        while its arguments are held."""
        index, judge = index_of(choice), self.filter
        self.outcome.generated(index, None)
        released = judge.arguments(index, call, arguments) if judge is not None else arguments
        if judge is not None and index in judge.blocked:
            return self._block(chunk)
        named = "id" in choice["delta"]["tool_calls"][0]
        reason = choice.get("finish_reason")
        out = []
        if judge is not None and reason is not None and (rest := judge.rest(index)):
            out.append(with_text(finished(chunk, reason), rest))  # held since the calls began
        if released == arguments and reason is None:
            out.append(chunk)
        elif released or named:  # the finish waits in the tail, as a text choice's
            out.append(with_arguments(chunk, released))
        if reason is not None:
            out += self._flush_calls(chunk, index)
            self.tail.append(finished(chunk, reason))
        self._mark_relayed(out, judge is not None)
        return out

    def _one_call_at_a_time(
        self, chunk: dict[str, Any], choice: dict[str, Any], calls: list[Any]
    ) -> list[dict[str, Any]]:
        """A delta with several calls (some servers send them so), taken apart so each
        call's arguments pass their own guard: its text, each call, then its finish."""
        text = {"content": choice["delta"]["content"]} if text_of(choice) else None
        parts = [text] if text else []
        parts += [{"tool_calls": [call]} for call in calls]
        out: list[dict[str, Any]] = []
        for i, delta in enumerate(parts):
            last = i == len(parts) - 1
            part = {**choice, "delta": delta}
            part["finish_reason"] = choice.get("finish_reason") if last else None
            out += self._on_choice({**chunk, "choices": [part]}, part)
        return out

    def _flush_calls(self, chunk: dict[str, Any], index: int) -> list[dict[str, Any]]:
        """What the guards of a finishing choice's tool calls still hold."""
        if self.filter is None:
            return []
        return [
            arguments_chunk(chunk, index, call, rest)
            for call, rest in self.filter.call_rests(index)
        ]

    def _block(self, chunk: dict[str, Any], released: str = "") -> list[dict[str, Any]]:
        """The choice is blocked: ``released`` (the text before where the phrase could
        start, which the push that blocked it gave back) goes out now, its finish
        (``content_filter``) is held with the others; the last choice blocked, the usage
        too (estimated, if the client asked for it and the replica has not sent it)."""
        out = [with_text(chunk, released)] if released else []
        self._mark_relayed(out, True)
        self.tail.append(finished(chunk, "content_filter"))
        assert self.filter is not None
        if (
            len(self.filter.blocked) >= self.choices
            and self.wants_usage
            and not any("usage" in c for c in self.tail)
        ):
            self.tail.append(self._estimated_usage(chunk))
        return out

    def _mark_relayed(self, sent: list[dict[str, Any]], guarded: bool) -> None:
        """When each text chunk goes out (the first: the client's first token)."""
        for c in sent:
            if text_of(c["choices"][0]) or call_part(c["choices"][0]) is not None:
                self.outcome.relayed(guarded)

    def _finish(self) -> list[str]:
        events = [c for c in self.tail if c.get("choices") or self.wants_usage]
        ends = sorted((c["choices"][0] for c in self.tail if c.get("choices")), key=index_of)
        reasons = [choice.get("finish_reason") for choice in ends]
        timings = self.outcome.ended([r for r in reasons if isinstance(r, str)])
        if events:
            events[-1]["timings"] = timings
            if self.ctx.first_token_held is not None:
                events[-1]["first_token_held"] = self.ctx.first_token_held
        self.finished = True
        return [event(c) for c in events] + ["data: [DONE]\n\n"]

    def _estimated_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = self.ctx.prompt_tokens, self.ctx.streamed_chunks
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**chunk, "choices": [], "usage": usage}

    def _broken(self, why: str) -> dict[str, Any]:
        return error_body(
            ServiceUnavailableError(
                f"{self.name} failed mid-stream ({why}); the answer is incomplete. "
                f"Retry the request (request id {self.ctx.request_id})."
            )
        )
