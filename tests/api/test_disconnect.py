"""Watching for a client's disconnect, and interrupting work with a reason."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from sendpath.api.disconnect import (
    ClientGone,
    ClientWatch,
    DisconnectSignal,
    Interrupt,
    wait_disconnect,
)


def test_waiting_for_a_disconnect_skips_the_body_messages() -> None:
    messages: list[Message] = [
        {"type": "http.request", "body": b"{}", "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Message:
        return messages.pop(0)

    asyncio.run(wait_disconnect(receive))
    assert messages == []


def test_a_fired_interrupt_raises_its_reason_in_the_block() -> None:
    async def run() -> str:
        async with Interrupt() as stop:
            asyncio.get_running_loop().call_soon(stop.fire, ClientGone())
            await asyncio.sleep(3600)
        return "not interrupted"

    with pytest.raises(ClientGone):
        asyncio.run(run())


def test_an_interrupt_fired_after_its_block_does_nothing_and_others_cancel_as_usual() -> None:
    async def run() -> tuple[str, bool]:
        async with Interrupt() as stop:
            await asyncio.sleep(0)
        stop.fire(ClientGone())  # too late: nothing to stop
        await asyncio.sleep(0)

        async def inner() -> None:
            async with Interrupt():
                await asyncio.sleep(3600)

        task = asyncio.create_task(inner())
        await asyncio.sleep(0)
        task.cancel()  # not the interrupt's: stays a cancellation
        await asyncio.wait({task})
        return "went on", task.cancelled()

    assert asyncio.run(run()) == ("went on", True)


def test_a_watch_calls_back_once_the_client_has_gone_and_not_after_it_is_unwatched() -> None:
    async def run() -> tuple[list[str], bool]:
        left = asyncio.Event()

        async def receive() -> Message:
            await left.wait()
            return {"type": "http.disconnect"}

        calls: list[str] = []
        watch = ClientWatch(receive)
        watch.on_gone(lambda: calls.append("first"))
        unwatch = watch.on_gone(lambda: calls.append("second"))
        unwatch()
        assert not watch.gone
        left.set()
        for _ in range(3):
            await asyncio.sleep(0)
        watch.on_gone(lambda: calls.append("late"))  # already gone: called all the same
        await asyncio.sleep(0)
        return calls, watch.gone

    assert asyncio.run(run()) == (["first", "late"], True)


def test_a_watch_on_the_servers_signal_calls_back_the_same_without_reading_receive() -> None:
    async def run() -> tuple[list[str], bool]:
        async def receive() -> Message:
            raise AssertionError("the signal says it: nothing waits on receive")

        signal = DisconnectSignal(asyncio.get_running_loop())
        calls: list[str] = []
        watch = ClientWatch(receive, signal)
        watch.on_gone(lambda: calls.append("first"))
        unwatch = watch.on_gone(lambda: calls.append("second"))
        unwatch()
        assert not watch.gone
        signal.set()  # as the server's protocol does when the connection is lost
        signal.set()  # once only
        assert watch.gone and calls == []  # called soon, on the loop
        await asyncio.sleep(0)
        watch.on_gone(lambda: calls.append("late"))  # already gone: called all the same
        unlate = watch.on_gone(lambda: calls.append("withdrawn"))
        unlate()
        await asyncio.sleep(0)
        watch.close()
        return calls, watch.gone

    assert asyncio.run(run()) == (["first", "late"], True)
