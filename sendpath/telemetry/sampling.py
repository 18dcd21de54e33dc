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
import random
from dataclasses import dataclass, field

from sendpath.telemetry.trace_context import SAMPLED, TraceParent, new_span_id

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
    # decided once, not per request: a trace id whose low 64 bits are below ``_bound`` is
    # sampled; ``_parent_based``: a caller's decision is kept
    _bound: int = field(init=False, repr=False, compare=False)
    _parent_based: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER is one of {', '.join(SAMPLERS)}; got {self.name!r}"
            )
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG is a ratio from 0 to 1; got {self.ratio}")
        rule = self.name.removeprefix("parentbased_")
        bound = {"always_on": _BOUND, "always_off": 0}.get(rule, round(self.ratio * _BOUND))
        object.__setattr__(self, "_bound", bound)
        object.__setattr__(self, "_parent_based", self.name.startswith("parentbased_"))

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
        if parent is not None:
            if self._parent_based:
                return TraceParent(parent.trace_id, new_span_id(), parent.flags)
            trace_id, flags = parent.trace_id, parent.flags
        else:
            trace_id, flags = random.getrandbits(128) or 1, 0
        keep = (trace_id & (_BOUND - 1)) < self._bound
        return TraceParent(trace_id, new_span_id(), flags | SAMPLED if keep else flags & ~SAMPLED)
