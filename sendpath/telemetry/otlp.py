"""OTLP's protobuf wire format for ``SpanRecord`` trees, written directly.

The SDK's encoder builds a protobuf message object per span, per attribute and per value
(about 30 microseconds a span here); a gateway request has eight spans, which made export
cost a third of the gateway's CPU per request (``benchmarks/README.md``). This writes
the same bytes (``ExportTraceServiceRequest`` of opentelemetry-proto; the tests decode
them with its generated classes) from the records, with the pieces that repeat from
request to request (attribute keys, and whole key-value pairs such as the operation or
the routing policy) encoded once and kept.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sendpath.telemetry.spans import AttributeValue, SpanRecord

__all__ = ["SpanTree", "encode_request", "encode_resource"]

_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_KINDS = {"internal": b"\x01", "server": b"\x02", "client": b"\x03"}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # Span.flags: whether the parent is remote
_CACHE_LIMIT = 4096  # key-value pairs kept encoded; past it the cache starts again


class _Sampled:
    """What the SDK's span processors read of a queued item (``context.trace_flags
    .sampled``): only sampled trees are queued."""

    class trace_flags:  # the SDK's attribute name
        sampled = True


@dataclass
class SpanTree:
    """One request's spans as queued for export: the root's place in its trace, the
    caller's span (``None``: the root starts the trace), and the offset that turns the
    records' clock readings into Unix time."""

    root: SpanRecord
    trace_id: int
    span_id: int
    parent_span_id: int | None
    flags: int
    offset: float

    @property
    def context(self) -> type[_Sampled]:
        return _Sampled


_SMALL = [bytes((n,)) for n in range(0x80)]  # the varints of one byte


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field."""
    n = len(data)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + data


def _any_value(value: AttributeValue) -> bytes:
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64, two's complement
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    values = b"".join(_field(b"\x0a", _any_value(v)) for v in value)
    return _field(b"\x2a", values)


_pairs: dict[tuple[str, AttributeValue], bytes] = {}


def _key_value(tag: bytes, key: str, value: AttributeValue) -> bytes:
    """One attribute (a ``KeyValue`` field of ``tag``); pairs of a key with a string,
    int or bool are kept encoded (floats, and lists, vary too much to be worth it)."""
    cacheable = not isinstance(value, float | list)
    if cacheable:
        encoded = _pairs.get((key, value))
        if encoded is not None:
            return encoded
    body = _field(b"\x0a", key.encode()) + _field(b"\x12", _any_value(value))
    encoded = _field(tag, body)
    if cacheable:
        if len(_pairs) >= _CACHE_LIMIT:
            _pairs.clear()
        _pairs[key, value] = encoded
    return encoded


def _attributes(tag: bytes, attributes: Mapping[str, AttributeValue]) -> list[bytes]:
    return [_key_value(tag, k, v) for k, v in attributes.items()]


_heads: dict[tuple[str, str], bytes] = {}


def _head(name: str, kind: str) -> bytes:
    """A span's name and kind fields (few pairs: kept encoded)."""
    encoded = _heads.get((name, kind))
    if encoded is None:
        encoded = _field(b"\x2a", name.encode()) + b"\x30" + _KINDS.get(kind, b"\x01")
        if len(_heads) >= _CACHE_LIMIT:
            _heads.clear()
        _heads[name, kind] = encoded
    return encoded


def _span(
    record: SpanRecord, trace: bytes, span_id: int, parent: bytes | None, flags: int, offset: float
) -> bytes:
    start = int((record.start + offset) * 1e9)
    end = max(start, int((record.end + offset) * 1e9))
    parts = [
        b"\x0a\x10", trace, b"\x12\x08", span_id.to_bytes(8, "big"),
        b"\x22\x08" + parent if parent is not None else b"",
        _head(record.name, record.kind), b"\x39", _FIXED64(start), b"\x41", _FIXED64(end),
    ]  # fmt: skip
    if record.attributes:
        parts += [_key_value(b"\x4a", k, v) for k, v in record.attributes.items()]
    if record.error is not None:
        parts.append(_key_value(b"\x4a", "error.type", record.error))
    for event_name, t in record.events:
        event = b"\x09" + _FIXED64(int((t + offset) * 1e9)) + _field(b"\x12", event_name.encode())
        parts.append(_field(b"\x5a", event))
    if record.error is not None:  # Status: its message, and code ERROR (2)
        parts.append(_field(b"\x7a", _field(b"\x12", record.error.encode()) + b"\x18\x02"))
    else:
        parts.append(b"\x7a\x00")  # UNSET, written out as the SDK's encoder does
    parts += [b"\x85\x01", struct.pack("<I", flags)]
    return _field(b"\x12", b"".join(parts))  # ScopeSpans.spans


def _tree(tree: SpanTree) -> list[bytes]:
    trace = tree.trace_id.to_bytes(16, "big")
    flags = _HAS_IS_REMOTE  # the parent's remoteness, as the SDK's encoder writes flags
    out: list[bytes] = []

    def walk(record: SpanRecord, span_id: int, parent: bytes | None, own_flags: int) -> None:
        out.append(_span(record, trace, span_id, parent, own_flags, tree.offset))
        here = span_id.to_bytes(8, "big")
        for child in record.children:
            child_id = child.span_id or (random.getrandbits(64) or 1)
            walk(child, child_id, here, flags)

    caller = tree.parent_span_id
    root_flags = flags | (_IS_REMOTE if caller is not None else 0)
    walk(tree.root, tree.span_id, caller.to_bytes(8, "big") if caller else None, root_flags)
    return out


def encode_resource(
    attributes: Mapping[str, AttributeValue], scope_name: str, scope_version: str
) -> tuple[bytes, bytes]:
    """A process's ``Resource`` and ``InstrumentationScope``, encoded once."""
    resource = b"".join(_attributes(b"\x0a", attributes))
    scope = _field(b"\x0a", scope_name.encode()) + _field(b"\x12", scope_version.encode())
    return resource, scope


def encode_request(resource: bytes, scope: bytes, trees: Iterable[SpanTree]) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``trees``' spans (``encode_resource``'s parts)."""
    spans = b"".join(b"".join(_tree(tree)) for tree in trees)
    scope_spans = _field(b"\x0a", scope) + spans
    resource_spans = _field(b"\x0a", resource) + _field(b"\x12", scope_spans)
    return _field(b"\x0a", resource_spans)
