"""The pre-rendered per-token SSE event is exactly the generic chunk."""

from __future__ import annotations

import json

import pytest

from sendpath.server.responses import Chunker, sse


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", ["hello", ' "quoted" \\ and\nnewline', "東京 🙂", ""])
def test_delta_sse_equals_the_generic_chunk(kind: str, text: str) -> None:
    c = Chunker(kind, "id-1", "tiny", 123)
    fast = c.delta_sse(text)
    assert fast == sse(c.chunk(text))
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    assert json.loads(fast[6:]) == c.chunk(text)
