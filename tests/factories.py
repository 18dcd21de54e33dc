"""Tiny factories for scheduler, KV and engine tests."""

from __future__ import annotations

from sendpath.clock import VirtualClock
from sendpath.config import SchedulerConfig
from sendpath.engine.scheduler import Scheduler
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
