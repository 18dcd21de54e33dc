"""What a replica's error means for the request and for the replica: one classifier for
every place an error comes back (an error answer, a stream that opens with an error event,
an error event mid-stream).

- ``FINAL``: the client's own fault (a 4xx other than 429) or the request's own failure
  (``request_failed``): passed on as it is, and the replica is fine.
- ``BUSY``: a 429, or a 503 ``queue_full``: another replica may take it; never counts
  towards ejection.
- ``BROKEN``: any other 5xx: another replica may take it, and it counts towards ejecting
  this one.
- ``KEY``: a 401 or 403, the replica refused the gateway's own key: the operator's to fix;
  counts as broken, and the client is told so without the replica's words.
"""

from __future__ import annotations

import enum
import json
from typing import Any

__all__ = ["Verdict", "error_code", "event_status", "verdict"]


class Verdict(enum.Enum):
    FINAL = "final"
    BUSY = "busy"
    BROKEN = "broken"
    KEY = "key"


def verdict(status: int, code: str | None) -> Verdict:
    """The verdict on an error with HTTP ``status`` and OpenAI error ``code``."""
    if status in (401, 403):
        return Verdict.KEY
    if status < 500 and status != 429:
        return Verdict.FINAL
    if code == "request_failed":
        return Verdict.FINAL
    if status == 429 or code == "queue_full":
        return Verdict.BUSY
    return Verdict.BROKEN


def error_code(raw: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body (``None``: not one)."""
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def event_status(error: dict[str, Any]) -> int:
    """The HTTP status an error event stands for: vLLM puts it in ``code``; ours names it."""
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 600:
        return code
    return {"request_failed": 500, "queue_full": 503, "service_unavailable": 503}.get(
        str(code), 502
    )
