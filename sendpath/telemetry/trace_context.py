"""W3C Trace Context (``traceparent``): parsing what a client sent, and what we send on.

``version-traceid-parentid-flags``: ``00-<32 hex>-<16 hex>-<2 hex>``, lowercase, neither id
all zeros. A header we cannot read is ignored (the request starts a new trace), as the
recommendation says; a later version's header is read by its first four fields.
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

__all__ = ["SAMPLED", "TraceParent", "new_span_id"]

SAMPLED = 0x01
_HEADER = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def new_span_id() -> int:
    """A random, non-zero 64-bit span id."""
    return random.getrandbits(64) or 1


class TraceParent(NamedTuple):
    """A span's place in a trace: the trace, the span itself, and the trace flags (a
    tuple: made twice a request, it costs a third of a frozen dataclass)."""

    trace_id: int
    span_id: int
    flags: int = SAMPLED

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    @classmethod
    def parse(cls, header: str | None) -> TraceParent | None:
        """The ``traceparent`` header's context, or ``None`` if it is absent or invalid."""
        if not header or len(header) > 512:
            return None
        match = _HEADER.fullmatch(header.strip())
        if match is None:
            return None
        version, trace, span, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest is not None):
            return None
        trace_id, span_id = int(trace, 16), int(span, 16)
        if trace_id == 0 or span_id == 0:
            return None
        return cls(trace_id, span_id, int(flags, 16))

    @classmethod
    def child_of(cls, parent: TraceParent | None) -> TraceParent:
        """A new span's context: in ``parent``'s trace (its flags too), else a new trace."""
        if parent is None:
            return cls(random.getrandbits(128) or 1, new_span_id())
        return cls(parent.trace_id, new_span_id(), parent.flags)

    def header(self) -> str:
        """This context as a ``traceparent`` value (hex of the ids' bytes: half the time of
        formatting the integers)."""
        flags = "01" if self.flags == SAMPLED else f"{self.flags & 0xFF:02x}"
        trace, span = self.trace_id.to_bytes(16, "big").hex(), self.span_id.to_bytes(8, "big").hex()
        return f"00-{trace}-{span}-{flags}"
