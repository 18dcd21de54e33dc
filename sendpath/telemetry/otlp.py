"""OTLP's protobuf wire format for ``SpanRecord`` trees, written directly.

The SDK's encoder builds a protobuf message object per span, per attribute and per value
(about 30 microseconds a span here); a gateway request has eight spans. This writes the
same bytes (``ExportTraceServiceRequest`` of opentelemetry-proto; the tests decode them
with its generated classes and compare them with the SDK's) in a few microseconds a span:
every field of a span but its name, attributes and events has a fixed size, so a span is
a handful of byte strings joined, and what repeats from request to request (a span's name
and kind, attribute keys, whole key-value pairs such as the operation or the routing
policy) is encoded once and kept.

``encode_tree`` runs where a request ends, so what waits in the export queue is bytes:
no objects for the garbage collector to walk while a batch fills. Where a C compiler and
Python's headers are present, ``prefer_native`` has ``otlp_native.c`` (built on first
use, ``sendpath/native.py``) write the same bytes: in a loaded gateway this encoder's
Python cost more than its loop suggests (each request's run of it finds little of it in
the CPU's caches), and the C one runs no Python per span.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from random import randbytes
from types import ModuleType

from sendpath.native import build_extension, prefer
from sendpath.telemetry.spans import AttributeValue, SpanRecord

__all__ = [
    "SpanTree",
    "encode_request",
    "encode_resource",
    "encode_tree",
    "encode_tree_python",
    "native_encoder",
    "prefer_native",
]

_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano (9), end_time_unix_nano (8)
_DOUBLE = struct.Struct("<d").pack
_FLAGS = struct.Struct("<I").pack
_KINDS = {"internal": b"\x30\x01", "server": b"\x30\x02", "client": b"\x30\x03"}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # Span.flags: whether the parent is remote
_CACHE_LIMIT = 4096  # key-value pairs kept encoded; past it the cache starts again
_CACHED_BYTES = 320  # longer pairs are not kept (a client's model name: 256 characters)
# attributes whose values differ from request to request: not worth keeping encoded
UNCACHED = frozenset({"sendpath.request_id", "gen_ai.response.id", "sendpath.client_id"})


class _Sampled:
    """What the SDK's span processors read of a queued tree (``context.trace_flags
    .sampled``): only sampled trees are queued."""

    class trace_flags:  # the SDK's attribute name
        sampled = True


@dataclass(slots=True)
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


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (a client's JSON can carry one) as "?", so
    a client cannot drop its own trace (``otlp_native.c`` does the same)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field."""
    n = len(data)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + data


def _any_value(value: AttributeValue) -> bytes:
    if isinstance(value, str):
        return _field(b"\x0a", _utf8(value))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64, two's complement
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    values = b"".join(_field(b"\x0a", _any_value(v)) for v in value)
    return _field(b"\x2a", values)


_keys: dict[str, bytes] = {}  # attribute key -> its KeyValue.key field
# (key, a string or int value) -> its KeyValue field
_pairs: dict[tuple[str, object], bytes] = {}


def _key_value(tag: bytes, key: str, value: AttributeValue) -> bytes:
    """One attribute (a ``KeyValue`` field of ``tag``); a key's pairs with a string or an
    int are kept encoded unless its values are each request's own (``UNCACHED``) or the
    pair is long. Not lists: a client's stop strings are one, and [1] and [True] would be
    equal keys."""
    pair: tuple[str, object] | None = None
    cls = value.__class__
    if (cls is str or cls is int) and key not in UNCACHED:  # not bool: (k, 1) == (k, True)
        pair = (key, value)
        encoded = _pairs.get(pair)
        if encoded is not None:
            return encoded
    head = _keys.get(key)
    if head is None:
        if len(_keys) >= _CACHE_LIMIT:
            _keys.clear()
        head = _keys[key] = _field(b"\x0a", _utf8(key))
    encoded = _field(tag, head + _field(b"\x12", _any_value(value)))
    if pair is not None and len(encoded) <= _CACHED_BYTES:
        if len(_pairs) >= _CACHE_LIMIT:
            _pairs.clear()
        _pairs[pair] = encoded
    return encoded


def _attributes(out: list[bytes], attributes: Mapping[str, AttributeValue]) -> None:
    """A span's attributes (``Span.attributes`` fields), each as ``_key_value`` writes
    it; a pair kept encoded is found without a call (most of a request's are)."""
    pairs = _pairs
    for key, value in attributes.items():
        cls = value.__class__
        if cls is str or cls is int:
            encoded = pairs.get((key, value))
            if encoded is not None:
                out.append(encoded)
                continue
        out.append(_key_value(b"\x4a", key, value))


_heads: dict[tuple[str, str], bytes] = {}


def _head(name: str, kind: str) -> bytes:
    """A span's name and kind fields (few pairs: kept encoded)."""
    encoded = _heads.get((name, kind))
    if encoded is None:
        encoded = _field(b"\x2a", _utf8(name)) + _KINDS.get(kind, b"\x30\x01")
        if len(_heads) >= _CACHE_LIMIT:
            _heads.clear()
        _heads[name, kind] = encoded
    return encoded


def _span(record: SpanRecord, pre: bytes, span_id: bytes, tail: bytes, offset: float) -> bytes:
    """One ``Span`` field of ``ScopeSpans``: ``pre``, its trace id and parent fields;
    ``tail``, its status (unset) and flags fields."""
    start = int((record.start + offset) * 1e9)
    end = int((record.end + offset) * 1e9)
    times = _TIMES(0x39, start, 0x41, end if end > start else start)
    head = _head(record.name, record.kind)
    if not (record.attributes or record.events) and record.error is None:  # a stage: most spans
        body = b"".join((pre, b"\x12\x08", span_id, head, times, tail))
        n = len(body)
        return b"\x12" + (_SMALL[n] if n < 0x80 else _varint(n)) + body
    parts = [pre, b"\x12\x08", span_id, head, times]
    if record.attributes:
        _attributes(parts, record.attributes)
    if record.error is not None:
        parts.append(_key_value(b"\x4a", "error.type", record.error))
    if record.events:
        for event_name, t in record.events:
            at = struct.pack("<BQ", 0x09, int((t + offset) * 1e9))
            parts.append(_field(b"\x5a", at + _field(b"\x12", _utf8(event_name))))
    if record.error is None:
        parts.append(tail)
    else:  # Status: its message, and code ERROR (2)
        parts.append(_field(b"\x7a", _field(b"\x12", _utf8(record.error)) + b"\x18\x02"))
        parts.append(tail[2:])  # the flags only
    body = b"".join(parts)
    n = len(body)
    return b"\x12" + (_SMALL[n] if n < 0x80 else _varint(n)) + body


def _span_id(record: SpanRecord) -> bytes:
    known = record.span_id
    return (known or random.getrandbits(64) or 1).to_bytes(8, "big")


_native: ModuleType | None = None  # the C encoder, once ``prefer_native`` loaded it


def native_encoder() -> ModuleType:
    """The C encoder (``otlp_native.c``), built here on first use; raises
    ``NativeBuildError`` saying why it cannot be."""
    here = Path(__file__).parent
    return build_extension("_sendpath_otlp", [here / "otlp_native.c", here / "otlp_wire.c"])


def prefer_native(native: bool = True) -> str:
    """Encode in C from now on where it can be built (``native=False``: in Python);
    says which encoder is used and, for Python, why."""
    global _native
    _native, how = (
        prefer(native_encoder, "telemetry/otlp_native.c") if native else (None, "in Python")
    )
    return how


def encode_tree(tree: SpanTree) -> bytes:
    """A tree's spans, each a ``Span`` field of ``ScopeSpans`` (``encode_request`` puts
    them in a request), parents before their children; in C once ``prefer_native``
    loaded it, else by ``encode_tree_python``. Equal bytes either way, but the ids of
    spans that have none are drawn."""
    native = _native
    if native is None:
        return encode_tree_python(tree)
    caller = tree.parent_span_id
    encoded: bytes = native.encode_tree(
        tree.root,
        tree.trace_id.to_bytes(16, "big"),
        tree.span_id.to_bytes(8, "big"),
        None if caller is None else caller.to_bytes(8, "big"),
        tree.offset,
    )
    return encoded


def encode_tree_python(tree: SpanTree) -> bytes:
    """``encode_tree`` in Python."""
    trace = b"\x0a\x10" + tree.trace_id.to_bytes(16, "big")
    # Span.flags as the SDK's encoder writes them: whether the parent is remote
    tail = b"\x7a\x00\x85\x01" + _FLAGS(_HAS_IS_REMOTE)  # after an UNSET status
    root_id = tree.span_id.to_bytes(8, "big")
    caller = tree.parent_span_id
    if caller is None:
        root = _span(tree.root, trace, root_id, tail, tree.offset)
    else:
        remote = b"\x7a\x00\x85\x01" + _FLAGS(_HAS_IS_REMOTE | _IS_REMOTE)
        root = _span(
            tree.root, trace + b"\x22\x08" + caller.to_bytes(8, "big"), root_id, remote, tree.offset
        )
    out = [root]
    _children(out, tree.root, trace, root_id, tail, tree.offset)
    return b"".join(out)


def _children(
    out: list[bytes], record: SpanRecord, trace: bytes, own: bytes, tail: bytes, offset: float
) -> None:
    pre = trace + b"\x22\x08" + own
    for child in record.children:
        child_id = _span_id(child)
        out.append(_span(child, pre, child_id, tail, offset))
        if child.children or child.stages:
            _children(out, child, trace, child_id, tail, offset)
    if record.stages:
        _stages(out, record.stages, pre, tail, offset)


# a bare stage's lead (its Span field's tag and length) and head (name and kind), by
# name: every field of such a span but these has a fixed size
_stage_fields: dict[str, tuple[bytes, bytes]] = {}
_NO_ID, _ID_ONE = bytes(8), (1).to_bytes(8, "big")


def _stages(
    out: list[bytes], stages: list[tuple[str, float, float]], pre: bytes, tail: bytes, offset: float
) -> None:
    """Bare stages (``SpanRecord.stages``) as ``_span`` writes spans without attributes,
    in one loop: their ids drawn at once, each span a join of parts known in advance."""
    ids = randbytes(8 * len(stages))
    known, times = _stage_fields, _TIMES
    for i, (name, start, end) in enumerate(stages):
        fields = known.get(name)
        if fields is None:
            head = _head(name, "internal")
            n = len(pre) + 10 + len(head) + 18 + len(tail)
            fields = (b"\x12" + _varint(n), head)
            if len(known) >= _CACHE_LIMIT:
                known.clear()
            known[name] = fields
        span_id = ids[8 * i : 8 * i + 8]
        if span_id == _NO_ID:  # not a valid span id
            span_id = _ID_ONE
        t0, t1 = int((start + offset) * 1e9), int((end + offset) * 1e9)
        lead, head = fields
        out.append(
            b"".join(
                (lead, pre, b"\x12\x08", span_id, head, times(0x39, t0, 0x41, max(t0, t1)), tail)
            )
        )


def encode_resource(
    attributes: Mapping[str, AttributeValue], scope_name: str, scope_version: str
) -> tuple[bytes, bytes]:
    """A process's ``Resource`` and ``InstrumentationScope``, encoded once."""
    resource = b"".join(_key_value(b"\x0a", k, v) for k, v in attributes.items())
    scope = _field(b"\x0a", _utf8(scope_name)) + _field(b"\x12", _utf8(scope_version))
    return resource, scope


def encode_request(resource: bytes, scope: bytes, trees: Iterable[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of encoded trees (``encode_tree``), from
    ``encode_resource``'s parts, joined once (a batch is megabytes)."""
    parts = list(trees)
    spans = sum(map(len, parts))
    scope_field = _field(b"\x0a", scope)
    # ResourceSpans{resource, ScopeSpans{scope, spans...}}, the spans' bytes last
    head = _field(b"\x0a", resource) + b"\x12" + _varint(len(scope_field) + spans) + scope_field
    return b"".join([b"\x0a", _varint(len(head) + spans), head, *parts])
