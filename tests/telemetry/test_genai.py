"""The GenAI request attributes keep only what the API itself takes from a client."""

from __future__ import annotations

from sendpath.telemetry.genai import MAX_MODEL, MAX_STOP, MAX_STOP_CHARS, request_attributes


def test_stop_sequences_are_kept_only_within_the_apis_bounds() -> None:
    ok = request_attributes("chat", {"model": "m", "stop": ["a", "b"]})
    assert ok["gen_ai.request.stop_sequences"] == ["a", "b"]
    assert request_attributes("chat", {"stop": "end"})["gen_ai.request.stop_sequences"] == ["end"]
    for refused in (
        ["x" * (MAX_STOP_CHARS + 1)],  # one long string: the request is refused anyway
        ["s"] * (MAX_STOP + 1),
        [],
        ["a", 3],
    ):
        attributes = request_attributes("chat", {"stop": refused})
        assert "gen_ai.request.stop_sequences" not in attributes
    long_model = request_attributes("chat", {"model": "m" * 10_000})
    assert long_model["gen_ai.request.model"] == "m" * MAX_MODEL
