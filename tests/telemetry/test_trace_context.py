"""W3C traceparent: what is continued, what is ignored, what is sent on."""

from __future__ import annotations

from sendpath.telemetry.trace_context import TraceParent

GIVEN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_header_is_read_and_written_back_alike() -> None:
    parent = TraceParent.parse(GIVEN)
    assert parent == TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
    assert parent.header() == GIVEN and parent.sampled


def test_a_child_stays_in_the_trace_with_its_flags_and_a_new_span() -> None:
    parent = TraceParent.parse(GIVEN.replace("-01", "-00"))
    assert parent is not None and not parent.sampled
    child = TraceParent.child_of(parent)
    assert child.trace_id == parent.trace_id and child.span_id != parent.span_id
    assert not child.sampled  # the caller decided not to sample: nor do we
    root = TraceParent.child_of(None)
    assert root.trace_id != 0 and root.span_id != 0 and root.sampled


def test_headers_that_are_not_valid_are_ignored() -> None:
    bad = [
        None, "", "garbage", GIVEN.upper(), GIVEN[:-1],
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        GIVEN + "-extra",  # version 00 has exactly four fields
        "00-" + "a" * 600,
    ]  # fmt: skip
    assert [TraceParent.parse(h) for h in bad] == [None] * len(bad)
    later = TraceParent.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more")
    assert later is not None and later.span_id == 0x00F067AA0BA902B7  # a later version
