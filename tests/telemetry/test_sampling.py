"""Head sampling from OTEL_TRACES_SAMPLER: the caller's decision kept, a ratio by trace id."""

from __future__ import annotations

import pytest

from sendpath.telemetry.sampling import Sampler
from sendpath.telemetry.trace_context import TraceParent

SAMPLED = TraceParent(0xABC, 0x1, 1)
UNSAMPLED = TraceParent(0xABC, 0x1, 0)


def test_parent_based_keeps_the_callers_decision_and_samples_new_traces() -> None:
    sampler = Sampler()
    assert sampler.start(SAMPLED).sampled and not sampler.start(UNSAMPLED).sampled
    assert sampler.start(None).sampled
    off = Sampler("parentbased_always_off")
    assert not off.start(None).sampled and off.start(SAMPLED).sampled


def test_a_ratio_samples_about_that_share_decided_by_the_trace_id() -> None:
    sampler = Sampler("traceidratio", 0.25)
    kept = sum(sampler.start(None).sampled for _ in range(4000))
    assert 800 < kept < 1200  # a quarter, give or take (random trace ids)
    assert not Sampler("traceidratio", 0.0).start(SAMPLED).sampled  # not parent based
    low = TraceParent((1 << 64) - 1, 1)  # the same trace: every service decides alike
    assert Sampler("traceidratio", 0.5).start(low).sampled is False
    assert Sampler("traceidratio", 0.5).start(TraceParent(5, 1)).sampled is True


def test_the_environment_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    assert Sampler.from_env() == Sampler("parentbased_traceidratio", 0.1)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "lots")
    with pytest.raises(ValueError, match="ratio from 0 to 1"):
        Sampler.from_env()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "jaeger_remote")
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER is one of"):
        Sampler.from_env()
