"""Reading a request body as JSON, with the limits an untrusted body needs.

``load_json`` turns raw bytes into a JSON object or raises ``InvalidRequestError``: bad
UTF-8, bad JSON, NaN / Infinity (Python's parser takes them, JSON does not), numbers that
overflow a float (``1e400`` would parse as infinity) or are too long for an int, a
top-level value that is not an object, nesting deeper than ``MAX_DEPTH``, and more than
``MAX_VALUES`` array items and object members in all. The last two are checked before
parsing by ``shape``, one linear pass at C speed, so a body of ten thousand ``[`` never
reaches the parser's recursion and a body of a million ``0,`` never becomes a million
Python objects. The size cap comes first: ``read_body`` reads a route's body and refuses
it with 413 past the limit (the gateway's ``BodyMiddleware`` does the same in ASGI).
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import numpy as np
from starlette.requests import Request

from sendpath.errors import InvalidRequestError, RequestTooLargeError

__all__ = ["MAX_DEPTH", "MAX_VALUES", "Shape", "load_json", "read_body", "shape"]

MAX_DEPTH = 64  # a chat body is 4-5 deep; JSON schemas in tools / response_format, ~20
MAX_VALUES = 2**20 + 4096  # a prompt of a million token ids, and the rest of its body

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, np.int8)  # what each structural byte does to the nesting depth
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_SPECIAL = np.zeros(256, bool)
_SPECIAL[[ord("["), ord("{"), ord("]"), ord("}"), ord(",")]] = True


class Shape(NamedTuple):
    depth: int  # how deep arrays and objects nest
    values: int  # array items and object members, roughly: the commas outside strings


def _string_edges(a: np.ndarray) -> np.ndarray:
    """Positions of the quotes that open or close a string: those not escaped by an odd
    run of backslashes before them."""
    quotes = np.flatnonzero(a == _QUOTE)
    slashes = np.flatnonzero(a == _BACKSLASH)
    if not slashes.size or not quotes.size:
        return quotes
    # where the run of consecutive backslashes that each backslash belongs to starts
    starts = np.ones(slashes.size, dtype=bool)
    starts[1:] = slashes[1:] != slashes[:-1] + 1
    run_start = slashes[np.maximum.accumulate(np.where(starts, np.arange(slashes.size), 0))]
    last = np.searchsorted(slashes, quotes) - 1  # the last backslash before each quote
    at = np.clip(last, 0, None)
    touching = (last >= 0) & (slashes[at] == quotes - 1)
    run = np.where(touching, quotes - run_start[at], 0)
    edges: np.ndarray = quotes[run % 2 == 0]
    return edges


def shape(raw: bytes) -> Shape:
    """The nesting depth and value count of a JSON text, brackets and commas inside strings
    not counted. Linear in the body whatever it holds (numpy, no backtracking), and its
    arrays are sized by the quotes, backslashes, brackets and commas, not the bytes."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets + raw.count(b",") <= 64:  # a small body: the counts bound both
        return Shape(brackets, raw.count(b","))
    a = np.frombuffer(raw, dtype=np.uint8)
    edges = _string_edges(a)
    specials = np.flatnonzero(_SPECIAL[a])
    outside = np.searchsorted(edges, specials) % 2 == 0  # an even number of edges before
    structural = a[specials[outside]]
    nesting = np.cumsum(_STEP[structural], dtype=np.int32)
    depth = int(nesting.max()) if nesting.size else 0
    return Shape(max(depth, 0), int(np.count_nonzero(structural == ord(","))))


def _reject_constant(name: str) -> Any:
    raise InvalidRequestError(
        f"The request body has {name}, which is not a JSON number; send a finite number."
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequestError(
            f"The number {text[:40]} in the request body is too large; send a finite number."
        )
    return value


# made once: json.loads with hooks builds a decoder (and its scanner) on every call
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def load_json(raw: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The body as a JSON object (``InvalidRequestError`` with what is wrong, else)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid UTF-8 (bad byte at position {exc.start})."
        ) from exc
    found = shape(raw)
    if found.depth > max_depth:
        raise InvalidRequestError(
            f"The request body nests {found.depth} levels deep; at most {max_depth} are accepted."
        )
    if found.values > MAX_VALUES:
        raise InvalidRequestError(
            f"The request body has about {found.values} values in its arrays and objects; "
            f"at most {MAX_VALUES} are accepted."
        )
    try:
        body = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno})."
        ) from exc
    except ValueError as exc:  # an int past Python's 4300 digits
        raise InvalidRequestError(
            "The request body has a number too long to read; send numbers of at most 4300 digits."
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; ``RequestTooLargeError`` (413) when its Content-Length says it is
    over ``limit`` (unread), or as soon as what arrives passes it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLargeError(len(body), limit)
    return bytes(body)
