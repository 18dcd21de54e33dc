"""What a request produces: token ids, text deltas and why it stopped.

``OutputStream`` is the per-request output processor shared by every runner: it detokenizes
incrementally, applies EOS / stop-token / stop-string / length rules, and holds back text
that might still turn into a stop string, so streamed text never shows a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from sendpath.model.tokenizer import IncrementalDetokenizer, Tokenizer
from sendpath.request import SamplingParams, TokenLogprobs

__all__ = ["CompletionOutput", "EngineOutput", "FinishReason", "OutputStream", "RequestOutput"]


class FinishReason(StrEnum):
    """Why generation ended, named as in the OpenAI API (``abort`` and ``error`` are ours)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the engine could not compute the request; it was stopped


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """A request's prompt and its outputs; ``finished`` once every output has a reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


@dataclass
class EngineOutput:
    """What one engine step produced for one request: new ids, new text, done or not."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text (a delta), stop strings held back until safe
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # generated so far, this one included
    logprobs: list[TokenLogprobs] | None = None  # one per new token, where asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputStream:
    """Turns sampled token ids into stable text deltas and a finish decision."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_len: int,
        max_model_len: int,
    ) -> None:
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer)
        self._eos = set() if params.ignore_eos else set(tokenizer.eos_token_ids)
        self._stop_ids = set(params.stop_token_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._max_new = min(params.max_tokens, max_model_len - prompt_len)
        self.token_ids: list[int] = []
        self.text = ""  # final text, stop string excluded
        self._sent = 0  # chars of the text already returned as deltas
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        """Record one sampled token; return the text that is now safe to show."""
        assert not self.finished, "append after finish"
        self.token_ids.append(token_id)
        if token_id in self._eos or token_id in self._stop_ids:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = None if token_id in self._eos else token_id
            self.text = self._detok.text
            return self._release(final=True)
        delta = self._detok.push([token_id])
        if len(self.token_ids) >= self._max_new:
            delta += self._detok.flush()
            self.finish_reason = FinishReason.LENGTH
        self.text = self._detok.text
        if delta and self.params.stop:
            self._check_stop(len(delta))
        return self._release(final=self.finished)

    def abort(self) -> None:
        """Mark the request aborted (client went away, server shutting down)."""
        if not self.finished:
            self.finish_reason = FinishReason.ABORT

    def fail(self) -> None:
        """Mark the request failed (a step could not compute or sample it)."""
        self.finish_reason = FinishReason.ERROR

    def output(self, index: int = 0) -> CompletionOutput:
        """A snapshot of what was generated so far."""
        return CompletionOutput(
            index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason
        )

    def _check_stop(self, new_chars: int) -> None:
        start = max(0, len(self.text) - new_chars - self._holdback)
        found = [
            (at, stop) for stop in self.params.stop if (at := self.text.find(stop, start)) != -1
        ]
        if found:
            at, stop = min(found)
            self.text = self.text[:at]
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._holdback)
        delta, self._sent = self.text[self._sent : end], max(self._sent, end)
        return delta
