"""The C encoder writes the Python encoder's bytes, and refuses what is not a span."""

from __future__ import annotations

from types import ModuleType

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

from sendpath.telemetry import otlp
from sendpath.telemetry.otlp import SpanTree, encode_tree, encode_tree_python
from sendpath.telemetry.spans import SpanRecord


def full_tree() -> SpanRecord:
    """Every kind of field, every span with an id of its own (no bare stages: their ids
    are drawn), an attribute long enough for two-byte lengths."""
    root = SpanRecord(
        "chat tiny",
        10.0,
        12.5,
        "server",
        {
            "gen_ai.operation.name": "chat",
            "n": -3,
            "big": 2**63 - 1,
            "ok": True,
            "no": False,
            "ratio": 0.25,
            "reasons": ["stop", "length"],
            "empty": [],
            "text": "é" * 200,
        },
    )
    root.children = [
        SpanRecord("gateway.auth", 10.0, 10.1, span_id=5),
        SpanRecord("attempt replica-0", 10.2, 11.0, "client", span_id=0xABC, error="502"),
        SpanRecord(
            "attempt replica-1",
            11.0,
            10.0,  # ends before it starts: written as zero-length
            "client",
            {"x": 1},
            span_id=2**64 - 1,
            events=[("preempted", 11.5), ("resumed", 11.6)],
        ),
    ]
    nested = SpanRecord("nested", 10.0, 10.05, "other", span_id=9)  # type: ignore[arg-type]
    root.children[0].children = [nested]  # an unknown kind is written as internal
    return root


@pytest.mark.parametrize("caller", [0x77, None], ids=["continued", "root"])
def test_the_c_encoder_writes_the_python_encoders_bytes(
    caller: int | None, native: ModuleType
) -> None:
    tree = SpanTree(full_tree(), 2**128 - 2, 0x99, caller, 1, 1_700_000_000.0)
    python = encode_tree_python(tree)
    otlp.prefer_native()
    try:
        assert encode_tree(tree) == python
    finally:
        otlp.prefer_native(False)


def test_bare_stages_get_distinct_ids_in_c(encoder: str) -> None:
    root = SpanRecord("chat tiny", 0.0, 1.0, "server")
    root.stages = [(f"stage {i}", 0.0, 1.0) for i in range(64)]
    encoded = encode_tree(SpanTree(root, 1, 2, None, 1, 0.0))
    spans = ScopeSpans.FromString(encoded).spans
    ids = {span.span_id for span in spans[1:]}
    assert len(ids) == 64 and bytes(8) not in ids
    assert all(span.parent_span_id == (2).to_bytes(8, "big") for span in spans[1:])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"key": {1, 2}}, "a span attribute cannot be set"),
        ({3: "x"}, "span attribute keys are strings"),
    ],
)
def test_the_c_encoder_refuses_what_is_not_an_attribute(
    bad: dict[object, object], message: str, native: ModuleType
) -> None:
    root = SpanRecord("chat", 0.0, 1.0, attributes=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        native.encode_tree(root, bytes(16), bytes(8), None, 0.0)
    with pytest.raises(ValueError, match="trace id: 16 bytes"):
        native.encode_tree(SpanRecord("chat", 0.0, 1.0), bytes(15), bytes(8), None, 0.0)


def _both(tree: SpanTree) -> tuple[bytes, bytes]:
    python = encode_tree_python(tree)
    otlp.prefer_native()
    try:
        return python, encode_tree(tree)
    finally:
        otlp.prefer_native(False)


def test_both_encoders_agree_on_edge_cases(native: ModuleType) -> None:
    root = SpanRecord("chat \ud800", 10.0, 11.0, "server", {"model": "bad \udfff text"})
    root.children = [
        SpanRecord("empty error", 10.0, 10.5, span_id=3, error=""),  # still an error
        # lists of other than strings (outside the type, written all the same): not
        # kept encoded, where [1] and [True] would be one key
        SpanRecord("lists", 10.0, 10.5, span_id=4, attributes={"a": [1], "b": [True]}),  # type: ignore[list-item]
        SpanRecord("lists again", 10.0, 10.5, span_id=5, attributes={"a": [True], "b": [1]}),  # type: ignore[list-item]
    ]
    python, c = _both(SpanTree(root, 1, 2, None, 1, 0.0))
    assert python == c
    spans = ScopeSpans.FromString(c).spans
    assert spans[0].name == "chat ?" and spans[0].attributes[0].value.string_value == (
        "bad ? text"
    )  # a lone surrogate a client sent does not cost the trace
    assert spans[1].status.code == 2  # ERROR
    values = [[kv.value.array_value.values[0] for kv in s.attributes] for s in spans[2:]]
    assert [v.WhichOneof("value") for v in values[0]] == ["int_value", "bool_value"]
    assert [v.WhichOneof("value") for v in values[1]] == ["bool_value", "int_value"]


def test_the_c_encoder_refuses_bad_records_without_crashing(native: ModuleType) -> None:
    cycle = SpanRecord("cycle", 0.0, 1.0)
    cycle.children = [cycle]
    with pytest.raises(RecursionError):
        native.encode_tree(cycle, bytes(16), bytes(8), None, 0.0)
    with pytest.raises(OverflowError, match="not a Unix time"):
        native.encode_tree(SpanRecord("past", -5.0, 1.0), bytes(16), bytes(8), None, 0.0)
    with pytest.raises(OverflowError, match="not a Unix time"):
        native.encode_tree(SpanRecord("nan", float("nan"), 1.0), bytes(16), bytes(8), None, 0.0)

    root = SpanRecord("r", 1.0, 2.0)

    class Clearing:  # a time whose reading drops the list being read
        def __float__(self) -> float:
            root.stages.clear()
            return 1.0

    root.stages = [(f"s{i}", Clearing(), 2.0) for i in range(100)]  # type: ignore[misc]
    spans = ScopeSpans.FromString(native.encode_tree(root, bytes(16), bytes(8), None, 0.0))
    assert [s.name for s in spans.spans] == ["r", "s0"]
