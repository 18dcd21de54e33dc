"""The queue of encoded spans (telemetry/batching.py): batches in order, a full batch
sent at once, a full queue dropping (and saying so, once), a failing or hung sender
costing ``put`` nothing, the OTEL_BSP_* sizes, and what is queued sent at shutdown."""

from __future__ import annotations

import logging
import threading

import pytest

from sendpath.telemetry.batching import SpanQueue
from tests.conftest import wait_for


class Sink:
    """A sender that keeps each batch; ``gate`` (if set) holds every send until opened."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.batches: list[list[bytes]] = []
        self.fail, self.gate, self.closed = fail, gate, False

    def send(self, batch: list[bytes]) -> bool:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ConnectionError("collector refused")
        self.batches.append(batch)
        return True

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _no_bsp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # only full batches go early


def test_a_full_batch_is_sent_at_once_in_order_and_the_rest_at_shutdown() -> None:
    sink = Sink()
    queue = SpanQueue(sink, max_queue=100, max_batch=3)
    for i in range(7):
        queue.put(b"%d" % i)
    wait_for(lambda: sum(map(len, sink.batches)) >= 6)
    queue.shutdown(5.0)
    assert [b for batch in sink.batches for b in batch] == [b"%d" % i for i in range(7)]
    assert all(len(batch) <= 3 for batch in sink.batches) and sink.closed
    queue.put(b"late")  # after shutdown: not queued, not sent
    assert b"late" not in [b for batch in sink.batches for b in batch]


def test_a_full_queue_drops_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    sink = Sink(gate=gate)
    queue = SpanQueue(sink, max_queue=4, max_batch=2)
    with caplog.at_level(logging.WARNING, logger="sendpath.telemetry"):
        queue.put(b"a")
        queue.put(b"b")  # a full batch: the thread takes it and waits at the gate
        wait_for(lambda: not queue._queue)
        for i in range(10):
            queue.put(b"%d" % i)
    assert queue.dropped == 6
    assert caplog.text.count("span export queue full") == 1
    gate.set()
    queue.shutdown(5.0)
    sent = [b for batch in sink.batches for b in batch]
    assert sent == [b"a", b"b", b"0", b"1", b"2", b"3"]


def test_a_sender_that_fails_is_logged_and_the_queue_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = Sink(fail=True)
    queue = SpanQueue(sink, max_queue=10, max_batch=1)
    with caplog.at_level(logging.ERROR, logger="sendpath.telemetry"):
        queue.put(b"x")
        wait_for(lambda: "could not be sent" in caplog.text)
        sink.fail = False
        queue.put(b"y")
        wait_for(lambda: sink.batches == [[b"y"]])
    queue.shutdown(5.0)


def test_shutdown_does_not_wait_past_its_time_for_a_hung_sender_and_sends_no_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = threading.Event()
    sink = Sink(gate=gate)
    queue = SpanQueue(sink, max_queue=10, max_batch=1)
    queue.put(b"x")
    wait_for(lambda: not queue._queue)  # the thread sends "x" and hangs at the gate
    queue.put(b"y")
    with caplog.at_level(logging.WARNING, logger="sendpath.telemetry"):
        queue.shutdown(0.05)  # returns though the send hangs, and shuts the sender
    assert sink.closed and "1 requests' spans still queued are dropped" in caplog.text
    thread = queue._thread
    assert thread is not None
    gate.set()  # the hung send returns: the thread ends without sending "y"
    thread.join(30)
    assert not thread.is_alive() and sink.batches == [[b"x"]]


def test_the_environment_sizes_the_queue_and_bad_values_are_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "50")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    queue = SpanQueue(Sink(), max_queue=4096, max_batch=2048)
    assert (queue.max_queue, queue.max_batch, queue.delay_s) == (50, 10, 0.25)
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "lots")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "-3")
    with caplog.at_level(logging.WARNING, logger="sendpath.telemetry"):
        queue = SpanQueue(Sink(), max_queue=4096, max_batch=8192)
    assert (queue.max_queue, queue.max_batch) == (4096, 4096)
    assert "OTEL_BSP_MAX_QUEUE_SIZE='lots' is not a positive integer" in caplog.text
    assert "OTEL_BSP_MAX_EXPORT_BATCH_SIZE='-3' is not a positive integer" in caplog.text
    assert "more than the queue holds" in caplog.text


def test_the_delay_sends_a_batch_that_is_not_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    sink = Sink()
    queue = SpanQueue(sink, max_queue=10, max_batch=5)
    queue.put(b"one")
    wait_for(lambda: sink.batches == [[b"one"]])
    queue.shutdown(5.0)


def test_bytes_bound_the_queue_and_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from sendpath.telemetry import batching

    monkeypatch.setattr(batching, "MAX_QUEUE_BYTES", 1000)
    monkeypatch.setattr(batching, "MAX_BATCH_BYTES", 250)
    gate = threading.Event()
    sink = Sink(gate=gate)
    queue = SpanQueue(sink, max_queue=100, max_batch=50)
    big = b"x" * 100
    for _ in range(12):  # 1,200 bytes: the last two do not fit
        queue.put(big)
    assert queue.dropped == 2
    gate.set()
    queue.shutdown(5.0)
    assert [len(batch) for batch in sink.batches] == [2, 2, 2, 2, 2]  # 200 bytes each
    queue = SpanQueue(Sink(), max_queue=100, max_batch=50)
    queue.put(b"y" * 300)  # larger than a batch alone: sent alone
    queue.shutdown(5.0)
    assert [len(b[0]) for b in queue.sender.batches] == [300]  # type: ignore[attr-defined]


def test_a_forked_child_sends_nothing() -> None:
    sink = Sink()
    queue = SpanQueue(sink, max_queue=10, max_batch=1)
    queue._forked()  # what os.fork's child runs
    queue.put(b"from the child")
    queue.shutdown(1.0)
    assert sink.batches == [] and queue._thread is None
