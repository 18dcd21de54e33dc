"""EngineCore on a tiny random model: prefix caching, timelines, stats, aborts."""

from __future__ import annotations

import pytest

from sendpath.clock import VirtualClock
from sendpath.config import SchedulerConfig
from sendpath.engine.core import EngineCore
from sendpath.errors import InvalidRequestError, PromptTooLongError, QueueFullError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel
from sendpath.request import SamplingParams
from sendpath.runner.model_runner import ModelRunner
from sendpath.trace import EventType, Stage

BLOCK = 16


def make_core(
    tiny: LoadedModel, blocks: int = 256, clock: VirtualClock | None = None, **sched: int
) -> EngineCore:
    kv = KVCacheManager(blocks, BLOCK)
    config = SchedulerConfig(**sched)  # type: ignore[arg-type]
    max_len = min(2048, blocks * BLOCK)
    return EngineCore(ModelRunner(tiny, blocks, BLOCK), tiny.tokenizer, kv, config, max_len, clock)


def run_one(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[int]:
    request = core.add_request(prompt, params)
    while core.has_unfinished_requests():
        core.step()
    return request.output_token_ids


def test_shared_1000_token_prefix_is_computed_once(tiny: LoadedModel) -> None:
    prefix = [1000 + (i * 37) % 5000 for i in range(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core = make_core(tiny, max_num_batched_tokens=256)
    run_one(core, [*prefix, 11, 12, 13], params)
    computed_before = core.stats().num_computed_tokens
    second = core.add_request([*prefix, 21, 22], params)
    while core.has_unfinished_requests():
        core.step()
    # at most one block of the shared prefix is computed again (here: its partial last block)
    assert 1000 - second.num_cached_tokens <= BLOCK
    assert second.num_cached_tokens == 992
    prompt_computed = core.stats().num_computed_tokens - computed_before - (8 - 1)
    assert prompt_computed == 1002 - 992
    # and the answer is the one a cold engine gives
    cold = run_one(make_core(tiny, max_num_batched_tokens=256), [*prefix, 21, 22], params)
    assert second.output_token_ids == cold
    stats = core.stats()
    assert stats.prefix_cache_hits == 992 and stats.prefix_cache_queries == 1003 + 1002


def test_chunked_prefill_gives_the_same_answer(tiny: LoadedModel) -> None:
    prompt = [500 + i for i in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    whole = run_one(make_core(tiny, max_num_batched_tokens=2048), prompt, params)
    chunked_core = make_core(tiny, max_num_batched_tokens=64)
    chunked = run_one(chunked_core, prompt, params)
    assert chunked == whole


def test_timeline_records_every_stage(tiny: LoadedModel) -> None:
    clock = VirtualClock(100.0)
    core = make_core(tiny, clock=clock, max_num_batched_tokens=32)
    request = core.add_request(
        list(range(600, 670)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    while core.has_unfinished_requests():
        clock.advance(0.5)
        core.step()
    types = [e.type for e in request.timeline.events]
    assert types == [
        EventType.ARRIVED,
        EventType.TOKENIZED,
        EventType.QUEUED,
        EventType.SCHEDULED,
        EventType.PREFILL_CHUNK,
        EventType.PREFILL_CHUNK,
        EventType.PREFILL_CHUNK,
        EventType.FIRST_TOKEN,
        EventType.TOKEN,
        EventType.TOKEN,
        EventType.TOKEN,
        EventType.FINISHED,
    ]
    assert [e.num_tokens for e in request.timeline.events if e.type is EventType.PREFILL_CHUNK] == [
        32,
        32,
        6,
    ]
    stages = request.timeline.stages()
    # scheduled at 100.5 (first step), tokens at 101.5, 102.0, 102.5
    assert stages[Stage.ENGINE_QUEUE] == pytest.approx(0.5)
    assert stages[Stage.PREFILL] == pytest.approx(1.0)
    assert stages[Stage.DECODE] == pytest.approx(1.0)
    assert request.timeline.ttft == pytest.approx(1.5)
    assert request.timeline.itls == pytest.approx([0.5, 0.5])


def test_abort_frees_blocks_at_any_point(tiny: LoadedModel) -> None:
    core = make_core(tiny, blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    queued = core.add_request(list(range(700, 740)), params)
    out = core.abort(queued.request_id)  # still waiting
    assert out is not None and out.finish_reason == "abort"
    mid_prefill = core.add_request(list(range(700, 740)), params)
    core.step()  # 16 of 40 tokens
    assert core.scheduler.kv.pool.num_free_blocks < 64
    core.abort(mid_prefill.request_id)
    decoding = core.add_request(list(range(700, 710)), params)
    for _ in range(5):
        core.step()
    assert len(decoding.output_token_ids) > 1
    core.abort(decoding.request_id)
    assert core.abort(decoding.request_id) is None
    assert core.scheduler.kv.pool.num_free_blocks == 64 and not core.has_unfinished_requests()


def test_bad_requests(tiny: LoadedModel) -> None:
    core = make_core(tiny, max_queued_requests=1)
    with pytest.raises(InvalidRequestError, match="empty"):
        core.add_request([], SamplingParams())
    with pytest.raises(PromptTooLongError):
        core.add_request([5] * 2048, SamplingParams())
    core.add_request([5, 6], SamplingParams())
    with pytest.raises(QueueFullError):
        core.add_request([5, 6], SamplingParams())
    assert len(core.scheduler.requests) == 1  # the refused one left nothing behind


def test_kv_cache_smaller_than_the_context_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="could never be scheduled"):
        EngineCore(
            ModelRunner(tiny, 4, BLOCK),
            tiny.tokenizer,
            KVCacheManager(4, BLOCK),
            SchedulerConfig(),
            2048,
        )


def test_an_int8_kv_cache_holds_more_tokens_and_serves(tiny: LoadedModel) -> None:
    from sendpath.config import CacheConfig, EngineConfig

    def engine(cache_dtype: str) -> EngineCore:
        cache = CacheConfig(kv_cache_memory_gib=0.002, cache_dtype=cache_dtype)
        return EngineCore.from_loaded(tiny, EngineConfig(max_model_len=256, cache=cache))

    own, int8 = engine("auto"), engine("int8")
    dim = tiny.config.head_dim  # float32 rows of dim values against dim codes and a scale
    blocks = own.scheduler.kv.pool.num_blocks, int8.scheduler.kv.pool.num_blocks
    assert abs(blocks[1] * (dim + 4) - blocks[0] * 4 * dim) <= 5 * dim + 4  # the same bytes
    assert int8.step_log()["engine"]["kv_cache_dtype"] == "int8"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [run_one(int8, list(range(10 + i, 40 + i)), params) for i in range(3)]
    assert all(len(t) == 8 for t in tokens)
    assert int8.scheduler.kv.pool.num_free_blocks == int8.scheduler.kv.pool.num_blocks


def test_a_kv_cache_dtype_that_cannot_be_says_what_to_pass(tiny: LoadedModel) -> None:
    from sendpath.config import CacheConfig, EngineConfig

    with pytest.raises(ValueError, match="'fp8' is not offered; use one of auto, bfloat16"):
        CacheConfig(cache_dtype="fp8")
    config = EngineConfig(max_model_len=256, cache=CacheConfig(cache_dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"needs a bfloat16 model.*pass --dtype bfloat16"):
        EngineCore.from_loaded(tiny, config)
