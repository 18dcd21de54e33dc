"""Tiny factories for scheduler, KV and engine tests."""

from __future__ import annotations

import threading

from sendpath.clock import VirtualClock
from sendpath.config import SchedulerConfig
from sendpath.engine.core import Runner
from sendpath.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from sendpath.kvcache.manager import KVCacheManager
from sendpath.request import Request, SamplingParams


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
    salt: str | None = None,
) -> Request:
    """A request; an int prompt means that many distinct tokens (100, 101, ...)."""
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_time=arrival,
        priority=priority,
        cache_salt=salt,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 16,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    max_queued_requests: int | None = None,
    caching: bool = True,
    long_prefill_token_threshold: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_queued_requests=max_queued_requests,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching), VirtualClock())


POISON = 4242  # a token id that makes ``FaultyRunner`` raise, as a bug for one input would


class FaultyRunner:
    """A runner around another (the real model runner, usually) that fails on purpose: a
    step holding ``POISON`` raises; ``gate``, when set, holds every step until it opens;
    ``device_ok = False`` breaks every step and the probe, as a lost GPU would."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.device_ok = True
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.gate is not None:
            self.in_step.set()
            self.gate.wait(30)
        self._check_device()
        if any(POISON in item.token_ids for item in plan.requests):
            raise IndexError("index out of range in self")
        return self.inner.execute(plan)

    def probe(self) -> None:
        self._check_device()
        self.inner.probe()

    def _check_device(self) -> None:
        if not self.device_ok:
            raise RuntimeError("CUDA error: an illegal memory access at 0xdeadbeef")
