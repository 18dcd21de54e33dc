"""The one classifier of a replica's errors: final, busy, broken, or our key refused."""

from __future__ import annotations

import pytest

from sendpath.gateway.verdict import Verdict, error_code, event_status, verdict


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "invalid_request_error", Verdict.FINAL),  # the client's own fault
        (404, "model_not_found", Verdict.FINAL),
        (500, "request_failed", Verdict.FINAL),  # the request's own failure
        (429, None, Verdict.BUSY),
        (503, "queue_full", Verdict.BUSY),
        (503, "service_unavailable", Verdict.BROKEN),
        (500, "internal_error", Verdict.BROKEN),
        (502, None, Verdict.BROKEN),
        (401, None, Verdict.KEY),
        (403, "forbidden", Verdict.KEY),
    ],
)
def test_verdicts(status: int, code: str | None, expected: Verdict) -> None:
    assert verdict(status, code) is expected


def test_codes_and_event_statuses() -> None:
    assert error_code(b'{"error": {"code": "queue_full"}}') == "queue_full"
    assert error_code(b"not json") is None and error_code(b'{"error": {"code": 5}}') is None
    assert event_status({"code": 503}) == 503  # vLLM's: the status itself
    assert event_status({"code": "request_failed"}) == 500
    assert event_status({"code": "something else"}) == 502
