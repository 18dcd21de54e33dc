"""The async engine: the step loop on its own thread, an async stream per request.

The event loop never runs model code. ``generate()`` tokenizes the request on a worker
thread and hands it to the engine thread (errors come back to the caller), then yields the
request's ``EngineOutput`` deltas as the thread produces them. Leaving the iterator early
(client gone, task cancelled) aborts the request, which frees its slot and KV blocks.

``snapshot`` is the scheduler's stats as of the last step, refreshed by the engine thread:
a health check reads it at once instead of queueing behind a long step. ``step_seconds()``
says how long the step in flight has run (0 between steps): a step that never returns
(a hung device, a deadlock) shows there.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import Any

from sendpath.engine.core import EngineCore, Prompt
from sendpath.engine.outputs import EngineOutput
from sendpath.engine.scheduler import SchedulerStats
from sendpath.request import Request, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or the device failed); the request cannot
    finish. Its text is for the log: clients get a plain 503."""


_Item = EngineOutput | BaseException


class AsyncEngine:
    """Runs an ``EngineCore`` in a background thread; thread-safe to call from asyncio.

    All of the model's torch work should happen on that one thread: on CPU, torch's OpenMP
    pool runs a step about twice as slowly when a second thread has also run torch ops (a
    model loaded on one thread and stepped on another: measured 20 vs 35-40 ms a decode
    step here). ``build(factory)`` therefore makes the core on the engine's own thread;
    passing a ready ``core`` (tests, the offline API) works too.
    """

    def __init__(self, core: EngineCore) -> None:
        self._start(core)

    @classmethod
    def build(cls, factory: Callable[[], EngineCore]) -> AsyncEngine:
        """Make the core with ``factory`` on the engine's thread, then run it there; blocks
        until it is made (raises what ``factory`` raised)."""
        engine = cls.__new__(cls)
        made: Future[EngineCore] = Future()

        def make() -> EngineCore:
            try:
                core = factory()
            except BaseException as exc:
                made.set_exception(exc)
                raise
            made.set_result(core)
            return core

        engine._start(None, make)
        made.result()
        return engine

    def _start(self, core: EngineCore | None, make: Callable[[], EngineCore] | None = None) -> None:
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item]]] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._step_started: float | None = None  # time.monotonic() of the step in flight
        if core is not None:
            self.core, self.snapshot = core, core.stats()
        self._make = make
        self._thread = threading.Thread(target=self._loop, name="sendpath-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    async def add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> RequestStream:
        """Queue a request; raises what ``EngineCore.add_request`` raises (bad prompt,
        queue full). Iterate the returned stream for its outputs.

        The chat template and tokenizer run on a worker thread, which hands the request
        straight to the engine's thread: the step loop does not stop for them (they share
        the GIL with it while they run). The request then waits for the step in flight to
        end; its ``engine.queue`` time starts at the hand-over."""
        self._check_running()  # before tokenizing: a dead engine is the answer, not a 400
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[_Item] = asyncio.Queue()
        added: Future[Request] = Future()

        def prepare_and_hand_over() -> Request:  # a worker thread, straight to the engine's
            request = self.core.prepare(
                prompt, params, request_id, priority, cache_salt, strict_max_tokens
            )
            handed_over = self.core.clock.now()

            def add() -> None:
                try:
                    self.core.enqueue(request, handed_over)
                except BaseException as exc:
                    added.set_exception(exc)
                    return
                self._streams[request.request_id] = (loop, outputs)
                added.set_result(request)

            self._submit(add)
            return request

        request = await asyncio.to_thread(prepare_and_hand_over)
        await asyncio.wrap_future(added)
        return RequestStream(self, request, outputs)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Queue a request and yield its outputs until it finishes (``add`` + iterate)."""
        stream = await self.add(prompt, params, request_id, priority, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:  # an early exit: do not wait for the inner iterator's finaliser
            if not stream.finished:
                stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with finish reason ``abort``."""
        if self._stopped.is_set():
            return
        self._commands.put(lambda: self._abort_now(request_id))

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run ``fn(core)`` on the engine thread between steps (stats, resets)."""
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.core))
            except BaseException as exc:
                fut.set_exception(exc)

        self._submit(run)
        return fut

    async def stats(self) -> SchedulerStats:
        """Running, waiting, KV usage, prefix-cache and preemption counters, read between steps."""
        stats: SchedulerStats = await asyncio.wrap_future(self.call(lambda core: core.stats()))
        return stats

    def step_seconds(self) -> float:
        """How long the step in flight has been running (0.0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine thread (``None``: running, or shut down on purpose)."""
        return self._error

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request's stream gets ``EngineDeadError``."""
        self._stopped.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _check_running(self) -> None:
        if self._stopped.is_set() or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")

    def _submit(self, command: Callable[[], None]) -> None:
        self._check_running()
        self._commands.put(command)

    def _abort_now(self, request_id: str) -> None:
        out = self.core.abort(request_id)
        if out is not None:
            self._deliver([out])

    def _deliver(self, items: list[EngineOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not per item."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        for item in items:
            entry = self._streams.get(item.request_id)
            if entry is None:
                continue
            if item.finished:
                del self._streams[item.request_id]
            batches.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _loop(self) -> None:
        if self._make is not None:
            try:
                self.core = self._make()
            except BaseException:
                self._stopped.set()
                return
            self.snapshot = self.core.stats()
        try:
            while not self._stopped.is_set():
                block = not self.core.has_unfinished_requests()
                try:
                    command = self._commands.get(block=block, timeout=0.5 if block else None)
                    command()
                    while True:  # everything else that is queued, before the next step
                        self._commands.get_nowait()()
                except queue.Empty:
                    pass
                if self.core.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    stepped = self.core.step()
                    self._step_started = None
                    self._deliver(stepped)
                self.snapshot = self.core.stats()
        except BaseException as exc:  # a failed step must not leave clients hanging
            self._error = exc
        finally:
            self._stopped.set()
            while True:  # run what raced in, so no caller waits on a future forever
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            dead = EngineDeadError(f"the engine stopped: {self._error or 'shut down'}")
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, dead)
            self._streams.clear()


def _put_all(batch: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue_, item in batch:
        queue_.put_nowait(item)


class RequestStream:
    """One request's outputs as an async iterator; leaving it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request: Request, outputs: asyncio.Queue[_Item]):
        self.engine = engine
        self.request = request  # its timeline is final once the stream has finished
        self._outputs = outputs
        self.finished = False

    async def __aiter__(self) -> AsyncGenerator[EngineOutput, None]:
        try:
            while not self.finished:
                item = await self._outputs.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        """Stop the request now (client gone); its blocks are freed by the engine thread."""
        self.finished = True
        self.engine.abort(self.request.request_id)
