"""Spans as plain data: what a server builds from a finished request's events, before any
exporter sees them (no OpenTelemetry import here, so building them costs nothing when
tracing is off and tests can read them directly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["AttributeValue", "SpanRecord"]

AttributeValue = str | bool | int | float | list[str]
Kind = Literal["server", "client", "internal"]


@dataclass(slots=True)
class SpanRecord:
    """One span: times on the server's clock (seconds), children within it."""

    name: str
    start: float
    end: float
    kind: Kind = "internal"
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    span_id: int | None = None  # set where others already know it (a traceparent sent)
    error: str | None = None  # ``error.type``; the span's status is then ERROR
    events: list[tuple[str, float]] = field(default_factory=list)  # (name, time)
    children: list[SpanRecord] = field(default_factory=list)
    # children that are bare stages (no attributes, events, id or children) as
    # (name, start, end): what most spans are, kept in the form that is cheapest to
    # build and to encode (``otlp.py``); ``all_children`` makes them records
    stages: list[tuple[str, float, float]] = field(default_factory=list)

    def all_children(self) -> list[SpanRecord]:
        """The children, the bare stages as records after the others."""
        return self.children + [SpanRecord(*stage) for stage in self.stages]

    def walk(self) -> list[SpanRecord]:
        """This span and all below it, parents first (the stages as records)."""
        out = [self]
        for child in self.all_children():
            out += child.walk()
        return out
