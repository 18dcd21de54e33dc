"""Timeline.stages: one pass over the events gives what the definitions give, read one
at a time (the reference below), for any order of events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sendpath.trace import EventType, Stage, Timeline


def reference(tl: Timeline) -> dict[Stage, float]:
    """Each stage from its definition, a scan of the events per question."""
    out: dict[Stage, float] = {}
    arrived = tl.first(EventType.ARRIVED)
    queued = tl.first(EventType.QUEUED) or tl.first(EventType.TOKENIZED)
    if arrived is not None and queued is not None:
        out[Stage.TOKENIZE] = queued - arrived
    before = after = 0.0
    since: float | None = None
    seen_token = False
    for e in tl.events:
        if e.type in (EventType.QUEUED, EventType.PREEMPTED):
            since = e.time
        elif e.type is EventType.SCHEDULED and since is not None:
            if seen_token:
                after += e.time - since
            else:
                before += e.time - since
            since = None
        elif e.type is EventType.FIRST_TOKEN:
            seen_token = True
    out[Stage.ENGINE_QUEUE] = before + after
    scheduled, first = tl.first(EventType.SCHEDULED), tl.first(EventType.FIRST_TOKEN)
    queued = tl.first(EventType.QUEUED)
    if scheduled is not None and queued is not None:
        end_of_prefill = first if first is not None else (tl.end or scheduled)
        out[Stage.PREFILL] = max(0.0, end_of_prefill - queued - before)
    if first is not None:
        last = tl.end or tl.token_times[-1]
        out[Stage.DECODE] = max(0.0, last - first - after)
    return out


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(list(EventType)), st.floats(0.0, 5.0, allow_nan=False)),
        max_size=30,
    )
)
def test_stages_are_the_definitions(events: list[tuple[EventType, float]]) -> None:
    tl = Timeline()
    t = 0.0
    for kind, gap in events:
        t += gap
        tl.record(kind, t)
    try:
        expected = reference(tl)
    except IndexError:
        with pytest.raises(IndexError):
            tl.stages()
        return
    assert tl.stages() == expected


def test_a_preempted_request_queues_twice() -> None:
    tl = Timeline()
    for kind, t in [
        (EventType.ARRIVED, 1.0),
        (EventType.TOKENIZED, 1.5),
        (EventType.QUEUED, 2.0),
        (EventType.SCHEDULED, 3.0),
        (EventType.FIRST_TOKEN, 4.0),
        (EventType.TOKEN, 4.0),
        (EventType.PREEMPTED, 5.0),
        (EventType.SCHEDULED, 7.0),
        (EventType.TOKEN, 8.0),
        (EventType.FINISHED, 9.0),
    ]:
        tl.record(kind, t)
    assert tl.stages() == {
        Stage.TOKENIZE: 1.0,
        Stage.ENGINE_QUEUE: 3.0,  # 1 s before the first token, 2 s after
        Stage.PREFILL: 1.0,
        Stage.DECODE: 3.0,
    }
