"""Reading a request body as JSON, with the limits an untrusted body needs.

``load_json`` turns raw bytes into a JSON object or raises ``InvalidRequestError``: bad
UTF-8, bad JSON, NaN / Infinity (Python's parser takes them, JSON does not), numbers that
overflow a float (``1e400`` would parse as infinity) or are too long for an int, a
top-level value that is not an object, and nesting deeper than ``MAX_DEPTH``, checked
before parsing so a body of ten thousand ``[`` cannot reach the parser's recursion.
The size cap is the caller's: it reads the body (and refuses it with 413) first.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from sendpath.errors import InvalidRequestError

__all__ = ["MAX_DEPTH", "json_depth", "load_json"]

MAX_DEPTH = 64  # a chat body is 4-5 deep; JSON schemas in tools / response_format, ~20
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_OPEN, _CLOSE = np.zeros(256, np.int32), np.zeros(256, np.int32)
_OPEN[[ord("["), ord("{")]] = 1
_CLOSE[[ord("]"), ord("}")]] = 1


def json_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in ``raw`` (brackets inside strings do not count):
    exactly when that is over ``limit``, else some number no larger than ``limit``.

    Linear in the body at C speed: a body with at most ``limit`` brackets is answered by
    counting them; otherwise strings are blanked out and the running depth is a cumsum.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return raw.count(b"[") + raw.count(b"{")
    bare = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    if bare.size == 0:
        return 0
    return int(np.cumsum(_OPEN[bare] - _CLOSE[bare]).max())


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


def load_json(raw: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The body as a JSON object (``InvalidRequestError`` with what is wrong, else)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid UTF-8 (bad byte at position {exc.start})."
        ) from exc
    if (depth := json_depth(raw, max_depth)) > max_depth:
        raise InvalidRequestError(
            f"The request body nests {depth} levels deep; at most {max_depth} are accepted."
        )
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno})."
        ) from exc
    except (ValueError, RecursionError) as exc:  # an int past Python's 4300 digits
        raise InvalidRequestError(
            "The request body has a number too long to read; send numbers of at most 4300 digits."
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body
