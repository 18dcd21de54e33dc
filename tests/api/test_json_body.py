"""Reading an untrusted body: depth, non-finite numbers and huge numbers are 400s."""

from __future__ import annotations

import json

import pytest

from sendpath.api.json_body import MAX_DEPTH, MAX_VALUES, load_json, shape
from sendpath.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"{}", 1),
        (b'{"a": [1, {"b": []}]}', 4),
        (b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', 1),
        (b'{"a": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', 1),
        (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", 101),
        (b"[" * 100_000, 100_000),
    ],
)
def test_depth_ignores_brackets_in_strings(raw: bytes, depth: int) -> None:
    padded = raw[:-1] + b', "pad": [' + b"0," * 70 + b"0]}" if raw.startswith(b"{") else raw
    assert shape(padded).depth == max(depth, 2 if padded is not raw else 0)  # the full scan
    assert shape(raw).depth >= depth  # a small body may be answered by counting: a bound


def test_depth_and_values_count_exactly_past_the_limit() -> None:
    raw = b'{"x": ' + b"[" * 70 + b'"]]],"' + b"]" * 70 + b', "y": [1, 2, "3,4"]}'
    assert shape(raw) == (71, 3)


def test_escaped_quotes_and_backslashes_end_strings_where_json_does() -> None:
    value = 'a\\"[[[ \\\\ "{{ "'  # backslashes before quotes, even and odd runs
    raw = json.dumps({"s": value, "t": [[[1]]], "pad": [0] * 80}).encode()
    assert json.loads(raw)["s"] == value and shape(raw) == (4, 81)


def test_too_many_values_are_refused_before_parsing() -> None:
    with pytest.raises(InvalidRequestError, match="at most"):
        load_json(b'{"prompt": [' + b"1," * (MAX_VALUES + 1) + b"1]}")


def test_deep_bodies_are_refused_before_parsing() -> None:
    ok = b'{"x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert load_json(ok)["x"]
    with pytest.raises(InvalidRequestError, match="nests 10001 levels deep; at most 64"):
        load_json(b'{"x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"t": NaN}', "NaN, which is not a JSON number"),
        (b'{"t": Infinity}', "Infinity"),
        (b'{"t": -Infinity}', "-Infinity"),
        (b'{"t": 1e400}', "1e400 in the request body is too large"),
        (b'{"t": ' + b"7" * 5000 + b"}", "number too long"),
        (b'{"t": 1', "not valid JSON"),
        (b'"text"', "must be a JSON object"),
        (b'{"t": "\xff"}', "not valid UTF-8"),
    ],
)
def test_what_json_itself_does_not_allow_is_a_400(raw: bytes, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says.replace("(", r"\(")):
        load_json(raw)


def test_finite_numbers_and_big_ints_that_fit_are_read() -> None:
    body = {"t": 1e300, "s": 2**70, "u": -0.0, "v": "NaN"}
    assert load_json(json.dumps(body).encode()) == body
