"""The engine core: ``step() = schedule() -> execute() -> update()``, plus requests in and out.

Single-threaded and synchronous: the offline ``LLM`` drives it directly, the async engine
drives it from its own thread. Text enters here (chat template + tokenization are timed as
the request's ``tokenize`` stage) and leaves as ``EngineOutput`` deltas.

One request cannot stop the engine. Inputs are checked when a request is prepared (token
ids inside the vocabulary, lengths); a step that still fails is run again one request at
a time (``engine/isolation.py``), and the requests that fail alone end with finish
reason ``error`` while the rest get their tokens.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from sendpath.clock import Clock, RealClock
from sendpath.config import EngineConfig, SchedulerConfig
from sendpath.engine.isolation import execute_isolated
from sendpath.engine.outputs import EngineOutput, OutputStream
from sendpath.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput, SchedulerStats
from sendpath.engine.speculative import Proposer, Speculator
from sendpath.engine.steps import StepLog, StepShape
from sendpath.errors import InvalidRequestError, PromptTooLongError
from sendpath.kvcache.events import AllBlocksCleared, KVEvent
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.tokenizer import Chat, ChatMessage, Tokenizer
from sendpath.request import Request, RequestStatus, SamplingParams, TokenLogprobs
from sendpath.speculative_config import SpeculativeConfig
from sendpath.trace import EventType

if TYPE_CHECKING:
    from sendpath.model.loader import LoadedModel

__all__ = ["EngineCore", "Prompt", "Runner"]

logger = logging.getLogger("sendpath.engine")

Prompt = str | list[int] | Sequence[ChatMessage] | Chat


class Runner(Protocol):
    """Executes a step plan; the model runner and the fake runner implement it."""

    def add_request(self, request: Request) -> None:
        """Start keeping ``request``'s sampling state (its parameters, RNG, and the token
        lists its penalties read, which the engine keeps current)."""
        ...

    def remove_request(self, request_id: str) -> None: ...
    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...
    def probe(self) -> None:
        """Raise if the device cannot compute at all (called after a step failed)."""
        ...


class EngineCore:
    """Owns the scheduler, the runner and each request's output stream."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        kv: KVCacheManager,
        scheduler_config: SchedulerConfig,
        max_model_len: int,
        clock: Clock | None = None,
        model_name: str = "model",
    ) -> None:
        if kv.capacity_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {kv.capacity_tokens} tokens, less than max_model_len "
                f"({max_model_len}): one long request could never be scheduled. Give the "
                "cache more memory or lower max_model_len."
            )
        self.clock = clock or RealClock()
        self.model_name = model_name
        self.loaded: LoadedModel | None = None  # set when built from a config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(scheduler_config, kv, self.clock)
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        # every step's shape and time: calibration from a live server
        self.steps = StepLog()
        self._kv_sink: Callable[[list[KVEvent]], None] | None = None
        self.speculator: Speculator | None = None

    def speculate(self, config: SpeculativeConfig | None, proposer: Proposer | None = None) -> None:
        """From now on, drafts proposed after each step (``engine/speculative.py``; with
        ``config`` None: none). Call it before the first request."""
        spec = None if config is None else Speculator(config, self.max_model_len, proposer)
        self.speculator = spec
        self.scheduler.speculative = spec is not None

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Clock | None = None) -> EngineCore:
        """Load the model and size the KV cache from ``config``."""
        from sendpath.model.loader import load_model

        loaded = load_model(
            config.model, config.dtype, config.device, quantization=config.quantization
        )
        return cls.from_loaded(loaded, config, clock)

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, config: EngineConfig, clock: Clock | None = None
    ) -> EngineCore:
        """An engine for a model already loaded (``config``'s model, dtype and device are
        the loaded one's): the KV cache sized from ``config``, its draft model if any."""
        from sendpath.engine.draft import load_draft
        from sendpath.runner.model_runner import ModelRunner, cache_blocks, kv_cache_dtype

        limit = loaded.max_model_len
        max_len = config.max_model_len or limit
        if not 1 < max_len <= limit:
            raise InvalidRequestError(
                f"max_model_len must be between 2 and the model's context ({limit}), "
                f"got {max_len}.",
                param="max_model_len",
            )
        cache = config.cache
        cache_dtype = kv_cache_dtype(cache.cache_dtype, loaded.model.dtype)
        num_blocks = cache_blocks(cache, loaded.config, cache_dtype)
        kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        runner = ModelRunner(loaded, num_blocks, cache.block_size, cache_dtype)
        proposer = load_draft(config, loaded, num_blocks, max_len)  # None: no draft model
        core = cls(runner, loaded.tokenizer, kv, config.scheduler, max_len, clock, loaded.name)
        core.speculate(config.speculative, proposer)
        core.loaded = loaded
        return core

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> Request:
        """Tokenize (chat template for a message list) and queue a request.

        ``strict_max_tokens``: refuse a request whose prompt + max_tokens exceeds the
        context (the OpenAI API's rule) instead of stopping it at the context's end.
        """
        return self.enqueue(
            self.prepare(prompt, params, request_id, priority, cache_salt, strict_max_tokens)
        )

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> Request:
        """The checked, tokenized request (``add_request``'s first half). It reads no engine
        state, so a server runs it on its own thread while the engine steps. Compiling a
        JSON schema's grammar (the first time: a second or so) counts as tokenizing."""
        arrived = self.clock.now()
        params.validate()
        if params.structured is not None:  # a schema without a grammar: 400, here
            from sendpath.model.structured import grammar_compiler

            grammar_compiler(self.tokenizer).grammar(params.structured)
        vocab = self.tokenizer.vocab_size
        if bad_bias := next((t for t in params.logit_bias if t >= vocab), None):
            raise InvalidRequestError(
                f"logit_bias has token id {bad_bias}, outside this model's vocabulary "
                f"(0 to {vocab - 1}).",
                param="logit_bias",
            )
        if isinstance(prompt, Chat):
            ids = self.tokenizer.encode_chat(prompt.messages, tools=prompt.tools)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], int):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            if not all(0 <= t < vocab for t in ids):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InvalidRequestError(
                    f"The prompt has token id {bad}, outside this model's vocabulary "
                    f"(0 to {vocab - 1}).",
                    param="prompt",
                )
        elif prompt:
            ids = self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
        else:
            ids = []
        if not ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        if strict_max_tokens and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's context window is {self.max_model_len} tokens, but the request "
                f"asks for {len(ids) + params.max_tokens} ({len(ids)} in the prompt, "
                f"{params.max_tokens} in max_tokens). Lower max_tokens to at most "
                f"{self.max_model_len - len(ids)}.",
                param="max_tokens",
            )
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=arrived,
            priority=priority,
            cache_salt=cache_salt,
        )
        request.record(EventType.ARRIVED, arrived)
        request.record(EventType.TOKENIZED, self.clock.now())
        return request

    def enqueue(self, request: Request, handed_over: float | None = None) -> Request:
        """Queue a prepared request (the engine's thread). ``handed_over``: when it was
        handed to this thread, the start of its wait (a step in flight ends first)."""
        params = request.sampling_params
        self.runner.add_request(request)
        try:  # QueueFullError: nothing may stay behind
            self.scheduler.add_request(request, handed_over)
        except BaseException:
            self.runner.remove_request(request.request_id)
            raise
        self._streams[request.request_id] = OutputStream(
            self.tokenizer, params, request.num_prompt_tokens, self.max_model_len
        )
        return request

    def abort(self, request_id: str) -> EngineOutput | None:
        """Stop a request wherever it is; frees its blocks. ``None`` if already gone."""
        stream = self._streams.pop(request_id, None)
        request = self.scheduler.finish_request(request_id, RequestStatus.ABORTED)
        self._forget(request_id)
        if stream is None or request is None:
            return None
        stream.abort()
        return self._output(request, stream, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineOutput]:
        """Schedule, execute and apply one step; return what each request got from it."""
        start = self.clock.now()
        plan = self.scheduler.schedule()
        result = execute_isolated(self.runner, plan)
        outputs = [
            out
            for request_id, why in result.failed.items()
            if (out := self._fail(request_id, why)) is not None
        ]
        drafted = (
            {item.request_id: item.num_drafts for item in plan.requests if item.num_drafts}
            if self.speculator is not None
            else None
        )
        for request, tokens in self.scheduler.update(plan, result):
            stream = self._streams[request.request_id]
            try:
                text, taken = self._append(request, stream, tokens)
            except Exception as exc:
                logger.exception("request %s: its output could not be made", request.request_id)
                if (out := self._fail(request.request_id, repr(exc))) is not None:
                    outputs.append(out)
                continue
            if drafted and (num_drafts := drafted.get(request.request_id)):
                assert self.speculator is not None
                # the drafts kept that the request kept too (a stop may come before some)
                kept = min(len(tokens) - 1, len(taken))
                self.speculator.verified(request, num_drafts, kept)
            tokens = taken
            if stream.finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED)
                self._forget(request.request_id)
                del self._streams[request.request_id]
            logprobs = result.logprobs.get(request.request_id)
            outputs.append(self._output(request, stream, tokens, text, logprobs))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        if not plan.is_empty:
            busy = self.scheduler.has_unfinished_requests()
            shape = StepShape.of(plan)
            self.steps.record(start, self.clock.now() - start, busy, shape)
        if self._kv_sink is not None and (kv := self.scheduler.kv).events:
            events, kv.events = kv.events, []
            self._kv_sink(events)
        return outputs

    @staticmethod
    def _append(request: Request, stream: OutputStream, tokens: list[int]) -> tuple[str, list[int]]:
        """Feed a step's new tokens to the request's output stream; the text they made and
        the tokens it took. A token that finishes the request (an end token, a stop
        string, its length) is its last: the ones a verified draft brought after it are
        dropped from the request."""
        if len(tokens) == 1:
            return stream.append(tokens[0]), tokens
        text = ""
        for taken, token in enumerate(tokens, 1):
            text += stream.append(token)
            if stream.finished and taken < len(tokens):
                dropped = len(tokens) - taken
                del request.output_token_ids[-dropped:], request.timeline.events[-dropped:]
                return text, tokens[:taken]
        return text, tokens

    def _forget(self, request_id: str) -> None:
        """A request left the engine: the runner's and the speculator's state of it go."""
        self.runner.remove_request(request_id)
        if self.speculator is not None:
            self.speculator.remove(request_id)

    def publish_kv_events(self, sink: Callable[[list[KVEvent]], None]) -> None:
        """From now on, hand ``sink`` each step's prefix-cache events (``kvcache/events.py``)
        at the end of that step, starting with ``AllBlocksCleared``: a subscriber forgets
        what it knew of this replica before (a restart). Call it before serving, on the
        engine's thread (``AsyncEngine.call``)."""
        self.scheduler.kv.events = [AllBlocksCleared()]
        self._kv_sink = sink

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.speculator is not None:
            stats.spec = self.speculator.stats.snapshot()
        return stats

    def step_log(self, after: int = 0) -> dict[str, Any]:
        """The logged steps after step ``after`` (shape and wall time) and the engine
        settings they ran under: what ``GET /v1/steps`` serves and `sendpath profile` fits."""
        sched, kv = self.scheduler, self.scheduler.kv
        describe = getattr(self.runner, "describe", None)  # the model runner's
        runs_on = describe() if describe is not None else {}
        return {
            "engine": {
                "device": runs_on.get("device", "unknown device"),
                "dtype": runs_on.get("dtype"),
                "quantization": runs_on.get("quantization"),
                "kv_cache_dtype": runs_on.get("kv_cache_dtype"),
                "attention": runs_on.get("attention"),
                "max_num_seqs": sched.config.max_num_seqs,
                "max_num_batched_tokens": sched.config.max_num_batched_tokens,
                "block_size": kv.block_size,
                "num_blocks": kv.pool.num_blocks,
                "max_model_len": self.max_model_len,
                "speculative": (
                    None if self.speculator is None else asdict(self.speculator.config)
                ),
            },
            "steps": [
                {"seq": r.seq, "start": r.start, "seconds": r.seconds, "busy_after": r.busy_after}
                | asdict(r.shape)
                for r in self.steps.since(after)
            ],
        }

    def _fail(self, request_id: str, why: str) -> EngineOutput | None:
        """End a request the engine could not compute; ``None`` if it is already gone."""
        logger.error("request %s stopped with an error: %s", request_id, why)
        stream = self._streams.pop(request_id, None)
        request = self.scheduler.finish_request(request_id, RequestStatus.FAILED)
        self._forget(request_id)
        if stream is None or request is None:
            return None
        stream.fail()
        return self._output(request, stream, [], "")

    @staticmethod
    def _output(
        request: Request,
        stream: OutputStream,
        new_ids: list[int],
        text: str,
        logprobs: TokenLogprobs | None = None,
    ) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            text=text,
            finish_reason=stream.finish_reason,
            stop_reason=stream.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            logprobs=None if logprobs is None else [logprobs],
        )
