"""The offline API, in the spirit of vLLM's: ``LLM(model).generate(...)`` / ``.chat(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

from sendpath.engine.outputs import CompletionOutput, OutputStream, RequestOutput
from sendpath.errors import InvalidRequestError, PromptTooLongError
from sendpath.model.loader import load_model
from sendpath.model.tokenizer import ChatMessage
from sendpath.request import SamplingParams
from sendpath.runner.sequence_runner import SequenceRunner

__all__ = ["LLM"]


class LLM:
    """Loads a model once and generates for prompts or conversations in this process.

    ``model=None`` is the built-in SmolLM2-135M-Instruct. ``dtype`` is ``"auto"`` (float32
    on CPU, bfloat16 on CUDA), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.loaded = load_model(model, dtype=dtype, device=device)
        self.tokenizer = self.loaded.tokenizer
        limit = self.loaded.max_model_len
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise InvalidRequestError(
                f"max_model_len must be between 2 and the model's context ({limit}), "
                f"got {max_model_len}.",
                param="max_model_len",
            )
        self.max_model_len = max_model_len or limit
        self._runner = SequenceRunner(self.loaded, self.max_model_len)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids) as plain text, no chat template."""
        items: list[str | list[int]] = [prompts] if isinstance(prompts, str) else [*prompts]
        params = sampling_params or SamplingParams()
        outs = []
        for item in items:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            prompt = item if isinstance(item, str) else None
            outs.append(self._complete(prompt, ids, params))
        return outs

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` dicts, or a list of them)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty.", param="messages")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        params = sampling_params or SamplingParams()
        outs = []
        for conv in convs:
            prompt = self.tokenizer.apply_chat_template(conv)  # type: ignore[arg-type]
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            outs.append(self._complete(prompt, ids, params))
        return outs

    def stream_chat(
        self, messages: Sequence[ChatMessage], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the answer's text deltas as they are generated."""
        ids = self.tokenizer.encode_chat(messages)
        params = sampling_params or SamplingParams()
        for step in self._runner.generate(ids, params, self._stream(ids, params)):
            if step.text:
                yield step.text

    def _stream(self, ids: list[int], params: SamplingParams) -> OutputStream:
        params.validate()
        if not ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        return OutputStream(self.tokenizer, params, len(ids), self.max_model_len)

    def _complete(
        self, prompt: str | None, ids: list[int], params: SamplingParams
    ) -> RequestOutput:
        stream = self._stream(ids, params)
        for _ in self._runner.generate(ids, params, stream):
            pass
        out: CompletionOutput = stream.output()
        return RequestOutput(str(next(self._ids)), prompt, ids, [out], finished=True)
