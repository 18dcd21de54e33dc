"""AsyncEngine: concurrent streams, abort on early exit, errors, shutdown."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from sendpath.config import SchedulerConfig
from sendpath.engine.async_engine import AsyncEngine, EngineDeadError
from sendpath.engine.core import EngineCore
from sendpath.engine.outputs import EngineOutput
from sendpath.errors import ModelLoadError, PromptTooLongError, QueueFullError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel
from sendpath.request import SamplingParams
from sendpath.runner.model_runner import ModelRunner
from sendpath.trace import EventType, Stage

BLOCKS, BLOCK = 64, 16


def make_engine(tiny: LoadedModel, max_queued_requests: int | None = None) -> AsyncEngine:
    kv = KVCacheManager(BLOCKS, BLOCK)
    config = SchedulerConfig(max_queued_requests=max_queued_requests)
    core = EngineCore(ModelRunner(tiny, BLOCKS, BLOCK), tiny.tokenizer, kv, config, 512)
    return AsyncEngine(core)


async def collect(engine: AsyncEngine, prompt: list[int], n: int) -> list[EngineOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [out async for out in engine.generate(prompt, params)]


def test_concurrent_streams_match_sequential(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompts = [[300 + i, 301 + i, 302 + i] * (i + 1) for i in range(4)]

    async def main() -> list[list[EngineOutput]]:
        return list(await asyncio.gather(*(collect(engine, p, 6) for p in prompts)))

    together = asyncio.run(main())
    stats = asyncio.run(engine.stats())
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_computed_tokens == sum(len(p) + 5 for p in prompts)
    alone = [asyncio.run(collect(engine, p, 6)) for p in prompts]
    for outs, ref in zip(together, alone, strict=True):
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
        assert len(outs) == 6 and outs[-1].finish_reason == "length"
        assert [o.finished for o in outs] == [False] * 5 + [True]
    engine.shutdown()


def test_leaving_early_aborts_and_frees_blocks(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        agen = engine.generate(list(range(400, 460)), params)
        async for out in agen:
            if out.num_output_tokens == 3:
                break
        await agen.aclose()  # what a server does when the client disconnects

        async def stats() -> tuple[int, int]:
            fut = engine.call(
                lambda c: (c.scheduler.kv.pool.num_free_blocks, len(c.scheduler.requests))
            )
            free, live = await asyncio.wrap_future(fut)
            return int(free), int(live)

        for _ in range(100):
            if await stats() == (BLOCKS, 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"blocks not freed: {await stats()}")

    asyncio.run(main())
    engine.shutdown()


def test_cancelled_task_aborts(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)

    async def main() -> None:
        task = asyncio.create_task(collect(engine, list(range(100, 140)), 400))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            n = await asyncio.wrap_future(engine.call(lambda c: len(c.scheduler.requests)))
            if n == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("cancelled request still in the engine")

    asyncio.run(main())
    engine.shutdown()


def test_errors_reach_the_caller(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, max_queued_requests=0)

    async def main() -> None:
        with pytest.raises(PromptTooLongError):
            await collect(engine, [5] * 600, 2)
        with pytest.raises(QueueFullError):
            await collect(engine, [5, 6], 2)

    asyncio.run(main())
    engine.shutdown()


def test_shutdown_fails_open_streams(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=5000, ignore_eos=True)
        agen = engine.generate(list(range(10, 20)), params)
        await agen.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2], 1)

    asyncio.run(main())
    assert not engine.is_running


def test_a_request_is_tokenized_off_the_engine_thread_and_queues_behind_the_step(
    tiny: LoadedModel,
) -> None:
    engine = make_engine(tiny)
    core = engine.core
    inside, gate = threading.Event(), threading.Event()
    execute = core.runner.execute

    def held(plan: Any) -> Any:  # every step waits for the gate
        inside.set()
        assert gate.wait(10)
        return execute(plan)

    core.runner.execute = held  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main() -> tuple[float, Any]:
        first = asyncio.ensure_future(collect(engine, [7] * 8, 2))
        await asyncio.to_thread(inside.wait, 10)  # a step in flight
        second = asyncio.ensure_future(engine.add("a few words to tokenize", params))
        await asyncio.sleep(0.3)
        released = core.clock.now()
        gate.set()
        stream = await second
        async for _ in stream:
            pass
        await first
        return released, stream.request.timeline

    released, tl = asyncio.run(main())
    engine.shutdown()
    # tokenized while the engine thread was held; queued from the hand-over, not from the
    # moment the engine thread took it in (after the step in flight)
    assert tl.first(EventType.TOKENIZED) < released
    assert tl.first(EventType.QUEUED) < released < tl.first(EventType.SCHEDULED)
    stages = tl.stages()
    assert stages[Stage.ENGINE_QUEUE] >= released - tl.first(EventType.QUEUED)
    assert stages[Stage.TOKENIZE] < stages[Stage.ENGINE_QUEUE]


def test_build_makes_the_core_on_the_engines_own_thread(tiny: LoadedModel) -> None:
    """All torch work on one thread: the model is made where it will run."""
    made_on: list[str] = []

    def factory() -> EngineCore:
        made_on.append(threading.current_thread().name)
        kv = KVCacheManager(BLOCKS, BLOCK)
        return EngineCore(
            ModelRunner(tiny, BLOCKS, BLOCK), tiny.tokenizer, kv, SchedulerConfig(), 512
        )

    engine = AsyncEngine.build(factory)
    try:
        assert made_on == ["sendpath-engine"] and engine.is_running
    finally:
        engine.shutdown()

    def broken() -> EngineCore:
        raise ModelLoadError("no such model")

    with pytest.raises(ModelLoadError, match="no such model"):
        AsyncEngine.build(broken)
