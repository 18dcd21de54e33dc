"""AsyncEngine: concurrent streams, abort on early exit, errors, shutdown."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
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


async def on_engine_thread_until(
    engine: AsyncEngine, read: Callable[[EngineCore], object], want: object, timeout: float = 20
) -> None:
    """Poll ``read(core)`` between steps until it gives ``want`` (AssertionError with the
    last value after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while (got := await asyncio.wrap_future(engine.call(read))) != want:
        assert time.monotonic() < deadline, f"still {got!r}, waiting for {want!r}"
        await asyncio.sleep(0.01)


def hold_steps(engine: AsyncEngine, after: int) -> tuple[threading.Event, threading.Event]:
    """Let the engine run ``after`` steps, then hold each step until the gate opens:
    (a held step is in flight, the gate)."""
    inside, gate = threading.Event(), threading.Event()
    execute, steps = engine.core.runner.execute, itertools.count()

    def held(plan: Any) -> Any:
        if next(steps) >= after:
            inside.set()
            assert gate.wait(20)
        return execute(plan)

    engine.core.runner.execute = held  # type: ignore[method-assign]
    return inside, gate


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

        def free_and_live(c: EngineCore) -> tuple[int, int]:
            return c.scheduler.kv.pool.num_free_blocks, len(c.scheduler.requests)

        await on_engine_thread_until(engine, free_and_live, (BLOCKS, 0))

    asyncio.run(main())
    engine.shutdown()


def test_cancelled_task_aborts(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    inside, gate = hold_steps(engine, after=1)  # the prompt's step, then held

    async def main() -> None:
        task = asyncio.create_task(collect(engine, list(range(100, 140)), 400))
        assert await asyncio.to_thread(inside.wait, 20)  # its first decode step: running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await on_engine_thread_until(engine, lambda c: len(c.scheduler.requests), 0)
        assert task.cancelled()

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
    inside, gate = hold_steps(engine, after=0)  # every step waits for the gate
    handed_over, submit = threading.Event(), engine._submit

    def submitted(command: Callable[[], None]) -> None:  # to the engine thread's inbox
        submit(command)
        handed_over.set()

    engine._submit = submitted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main() -> tuple[float, Any]:
        first = asyncio.ensure_future(collect(engine, [7] * 8, 2))
        assert await asyncio.to_thread(inside.wait, 20)  # a step in flight
        handed_over.clear()  # the first request's hand-over
        second = asyncio.ensure_future(engine.add("a few words to tokenize", params))
        assert await asyncio.to_thread(handed_over.wait, 20)  # tokenized, handed over
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
    # (not compared with tokenize's duration: which is longer depends on the host's speed)


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
