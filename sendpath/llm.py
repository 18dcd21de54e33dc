"""The offline API, in the spirit of vLLM's: ``LLM(model).generate(...)`` / ``.chat(...)``.

All prompts of one call go into the engine together and run with continuous batching.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.engine.core import EngineCore, Prompt
from sendpath.engine.outputs import CompletionOutput, RequestOutput
from sendpath.errors import InvalidRequestError
from sendpath.model.tokenizer import ChatMessage
from sendpath.request import SamplingParams
from sendpath.speculative_config import SpeculativeConfig

__all__ = ["LLM"]


class LLM:
    """Loads a model once and generates for prompts or conversations in this process.

    ``model=None`` is the built-in SmolLM2-135M-Instruct. ``dtype`` is ``"auto"`` (bfloat16
    on CUDA and on CPUs that compute it natively, else float32), ``"float32"``,
    ``"bfloat16"`` or ``"float16"``; ``quantization`` is ``"auto"`` (the model's own
    four-bit weights for small steps on such a CPU), ``"none"``, ``"int8"`` or ``"int4"``.
    The engine options (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``kv_cache_memory_gib``, ``num_blocks``, ``enable_prefix_caching``) are vLLM's, and
    so is ``speculative_config`` (a dict or its JSON: ``{"method": "ngram",
    "num_speculative_tokens": 4}``, ``config.SpeculativeConfig``).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        kv_cache_memory_gib: float = 1.0,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        speculative_config: str | dict[str, object] | None = None,
    ) -> None:
        speculative = (
            None if speculative_config is None else SpeculativeConfig.parse(speculative_config)
        )
        config = EngineConfig(
            model=None if model is None else str(model),
            dtype=dtype,
            quantization=quantization,
            device=device,
            max_model_len=max_model_len,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            cache=CacheConfig(block_size, num_blocks, kv_cache_memory_gib, enable_prefix_caching),
            speculative=speculative,
        )
        self.engine = EngineCore.from_config(config)
        assert self.engine.loaded is not None
        self.loaded = self.engine.loaded
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids) as plain text, no chat template."""
        items: list[str | list[int]] = [prompts] if isinstance(prompts, str) else [*prompts]
        return self._run(items, sampling_params or SamplingParams())

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` dicts, or a list of them)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty.", param="messages")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        return self._run(convs, sampling_params or SamplingParams())  # type: ignore[arg-type]

    def stream_chat(
        self, messages: Sequence[ChatMessage], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the answer's text deltas as they are generated."""
        request = self.engine.add_request(messages, sampling_params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.text:
                        yield out.text
                    if out.finished:
                        return
        finally:
            self.engine.abort(request.request_id)  # no-op once finished

    def _run(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[RequestOutput]:
        requests = []
        try:
            for prompt in prompts:
                requests.append(self.engine.add_request(prompt, params))
            by_id = {r.request_id: r for r in requests}
            texts = dict.fromkeys(by_id, "")
            done: dict[str, CompletionOutput] = {}
            while len(done) < len(requests):
                for out in self.engine.step():
                    texts[out.request_id] += out.text
                    if out.finished:
                        done[out.request_id] = CompletionOutput(
                            0,
                            texts[out.request_id],
                            list(by_id[out.request_id].output_token_ids),
                            out.finish_reason,
                            out.stop_reason,
                        )
        finally:
            for r in requests:
                self.engine.abort(r.request_id)  # frees anything left after an error
        return [
            RequestOutput(
                r.request_id,
                p if isinstance(p, str) else None,
                r.prompt_token_ids,
                [done[r.request_id]],
                finished=True,
            )
            for r, p in zip(requests, prompts, strict=True)
        ]
