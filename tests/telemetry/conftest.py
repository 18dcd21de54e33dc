"""Both OTLP encoders: each encoding test that takes ``encoder`` runs on the Python one and
on the C one (``native``, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sendpath.telemetry.otlp import prefer_native


@pytest.fixture(params=["python", "c"])
def encoder(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "c":
        request.getfixturevalue("native")
    prefer_native(request.param == "c")
    try:
        yield request.param
    finally:
        prefer_native(False)
