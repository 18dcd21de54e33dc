"""What the answer side keeps of a replica's chunks (gateway/outcome.py)."""

from __future__ import annotations

from sendpath.clock import SettableClock
from sendpath.gateway.context import GatewayContext
from sendpath.gateway.outcome import Outcome


def test_the_answer_id_is_the_first_text_id_a_replica_sent() -> None:
    ctx = GatewayContext(SettableClock(), 0.0)
    outcome = Outcome(ctx, None, None, lambda ctx: None)  # type: ignore[arg-type]
    for chunk in ({"id": {"not": "text"}}, {"id": ""}, {"id": 7}, {}):
        outcome.noted(chunk)  # an id that is not text: the trace store could not key it
        assert ctx.response_id is None
    outcome.noted({"id": "chatcmpl-1"})
    outcome.noted({"id": "chatcmpl-2"})
    assert ctx.response_id == "chatcmpl-1"
