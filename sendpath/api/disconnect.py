"""Noticing that a client left, and stopping the work done for it.

An ASGI server tells an app that its client disconnected through ``receive()`` (an
``http.disconnect`` message, once the request's body has been read), so something must
wait on it: ``wait_disconnect``. ``ClientWatch`` is that wait as one task per request,
which any number of callbacks can follow; where the server says so itself (sendpath's
own, ``http_server.GuardedProtocol``, puts a ``DisconnectSignal`` in the scope's
extensions, set when the connection is lost), the watch follows that instead and needs
no task. ``Interrupt`` cancels the task running its block when a callback says so
(``fire``) and turns that cancellation into the exception it was given, the way
``asyncio.timeout`` turns its own into ``TimeoutError``: a watcher (the client, a
replica's health) stops work without a task of its own per piece of work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from starlette.types import Receive, Scope

__all__ = [
    "SIGNAL_KEY",
    "ClientGone",
    "ClientWatch",
    "DisconnectSignal",
    "Interrupt",
    "signal_of",
    "wait_disconnect",
]

SIGNAL_KEY = "sendpath.disconnect"  # in scope["extensions"]: the server's DisconnectSignal


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (its request's body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectSignal:
    """A server's word that one request's client disconnected (``set``, on the loop):
    what ``receive()`` would say, without a task waiting on it. Callbacks run soon after,
    on the loop; one added once it is set runs soon too."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.gone = False
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if self.gone:
            return
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self.loop.call_soon(callback)

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once set; returns what stops that."""
        if self.gone:
            return self.loop.call_soon(callback).cancel

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        self._callbacks.append(callback)
        return unsubscribe


def signal_of(scope: Scope) -> DisconnectSignal | None:
    """The server's disconnect signal for this request, if it gives one."""
    extensions = scope.get("extensions")
    signal = extensions.get(SIGNAL_KEY) if extensions else None
    return signal if isinstance(signal, DisconnectSignal) else None


class ClientWatch:
    """One request's client, watched from now until ``close()``: through the server's
    ``signal`` when there is one, else by a task waiting on ``receive``."""

    def __init__(self, receive: Receive, signal: DisconnectSignal | None = None) -> None:
        self._signal = signal
        self._gone = False
        self._task = None if signal is not None else asyncio.ensure_future(self._watch(receive))

    @property
    def gone(self) -> bool:
        """The client has disconnected."""
        return self._signal.gone if self._signal is not None else self._gone

    async def _watch(self, receive: Receive) -> None:
        try:
            await wait_disconnect(receive)
            self._gone = True
        except asyncio.CancelledError:  # closed: end quietly. A task that keeps its
            pass  # CancelledError keeps the request's frames in a reference cycle

    def on_gone(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (soon, on the loop) when the client disconnects; already gone:
        soon. Returns what stops it being called."""
        if self._signal is not None:
            return self._signal.subscribe(callback)
        task = self._task
        assert task is not None

        def done(task: asyncio.Future[None]) -> None:
            if self._gone:
                callback()

        def unwatch() -> None:
            task.remove_done_callback(done)

        task.add_done_callback(done)
        return unwatch

    def close(self) -> None:
        """Stop watching (the response is over)."""
        if self._task is not None:
            self._task.cancel()


class Interrupt:
    """``async with Interrupt() as stop:`` runs a block that ``stop.fire(exc)`` (a callback
    on the same loop) cancels; the block then raises ``exc`` instead of ``CancelledError``.
    Only the first ``fire`` counts; one after the block ended does nothing. A cancellation
    from elsewhere stays a ``CancelledError``."""

    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._reason: BaseException | None = None

    async def __aenter__(self) -> Interrupt:
        self._task = asyncio.current_task()
        assert self._task is not None, "Interrupt runs inside a task"
        self._cancelling = self._task.cancelling()
        return self

    def fire(self, reason: BaseException) -> None:
        """Stop the block with ``reason``."""
        if self._task is not None and self._reason is None:
            self._reason = reason
            self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, reason, self._task = self._task, self._reason, None
        if reason is None or task is None:
            return
        if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise reason from None
