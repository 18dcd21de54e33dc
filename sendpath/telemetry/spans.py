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

    def walk(self) -> list[SpanRecord]:
        """This span and all below it, parents first."""
        out = [self]
        for child in self.children:
            out += child.walk()
        return out
