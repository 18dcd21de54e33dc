"""Head sampling as OpenTelemetry's environment configures it.

``OTEL_TRACES_SAMPLER``: ``parentbased_always_on`` (the default: a caller's decision is
kept, a new trace is sampled), ``parentbased_always_off``, ``parentbased_traceidratio``,
``always_on``, ``always_off`` or ``traceidratio``; ``OTEL_TRACES_SAMPLER_ARG`` is the ratio
(0 to 1, default 1) of the ``traceidratio`` ones, decided from the trace id as the SDK's
``TraceIdRatioBased`` does, so every service of a trace decides alike. The decision is
carried on in the ``traceparent``'s sampled flag: a replica behind a gateway keeps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sendpath.telemetry.trace_context import SAMPLED, TraceParent

__all__ = ["SAMPLERS", "Sampler"]

SAMPLERS = (
    "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
    "always_on", "always_off", "traceidratio",
)  # fmt: skip
_BOUND = 1 << 64  # the ratio is applied to the trace id's low 64 bits


@dataclass(frozen=True)
class Sampler:
    name: str = "parentbased_always_on"
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER is one of {', '.join(SAMPLERS)}; got {self.name!r}"
            )
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG is a ratio from 0 to 1; got {self.ratio}")

    @classmethod
    def from_env(cls) -> Sampler:
        name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or SAMPLERS[0]
        arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER_ARG is a ratio from 0 to 1; got {arg!r}"
            ) from None
        return cls(name, ratio)

    def start(self, parent: TraceParent | None) -> TraceParent:
        """A server span's context: in ``parent``'s trace if there is one, sampled as
        this sampler decides."""
        child = TraceParent.child_of(parent)
        if parent is not None and self.name.startswith("parentbased_"):
            return child  # the caller's decision
        rule = self.name.removeprefix("parentbased_")
        if rule == "always_on":
            keep = True
        elif rule == "always_off":
            keep = False
        else:
            keep = (child.trace_id & (_BOUND - 1)) < round(self.ratio * _BOUND)
        flags = child.flags | SAMPLED if keep else child.flags & ~SAMPLED
        return TraceParent(child.trace_id, child.span_id, flags)
