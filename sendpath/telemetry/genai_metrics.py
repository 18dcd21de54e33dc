"""The GenAI semantic conventions' server metrics, in a Prometheus registry beside ours.

``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token`` and
``gen_ai.server.time_per_output_token`` (seconds, with the conventions' bucket
boundaries), named as OpenTelemetry's Prometheus exporter names them
(``gen_ai_server_request_duration_seconds``...), labelled by operation and model, and the
duration also by ``error_type`` (empty when it succeeded). Both servers record them from
the same events their traces come from.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["GenAIMetrics"]

# the boundaries the conventions advise for each
DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
            81.92)  # fmt: skip
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0)  # fmt: skip
TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LABELS = ["gen_ai_operation_name", "gen_ai_request_model"]


class GenAIMetrics:
    """The three histograms in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "GenAI server request duration (gen_ai.server.request.duration).",
            [*LABELS, "error_type"],
            buckets=DURATION,
            registry=registry,
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to generate the first token (gen_ai.server.time_to_first_token).",
            LABELS,
            buckets=TTFT,
            registry=registry,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (gen_ai.server.time_per_output_token).",
            LABELS,
            buckets=TPOT,
            registry=registry,
        )
        # each label set's children, looked up once (``labels`` takes a lock and hashes)
        self._children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}

    def _of(self, operation: str, model: str, error_type: str) -> tuple[Any, Any, Any]:
        key = (operation, model, error_type)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.duration.labels(operation, model, error_type),
                self.ttft.labels(operation, model),
                self.tpot.labels(operation, model),
            )
        return children

    def observe(
        self,
        operation: str,
        model: str,
        duration: float,
        error_type: str | None = None,
        ttft: float | None = None,
        output_tokens: int = 0,
    ) -> None:
        """One request that ended (``ttft`` and ``output_tokens``: if it answered). The
        labels' values must come from a bounded set (the servers pass a served model's
        name, or none)."""
        total, first, per_token = self._of(operation, model, error_type or "")
        total.observe(duration)
        if ttft is None:
            return
        first.observe(ttft)
        if output_tokens > 1:
            per_token.observe(max(0.0, duration - ttft) / (output_tokens - 1))
