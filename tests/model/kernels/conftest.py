"""The CPU kernels, built once for the runner's tests (CI must be able to build them)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from sendpath.model.kernels import cpu_kernels


@pytest.fixture(scope="session")
def kernel() -> Any:
    built = cpu_kernels()
    if built is None:
        reason = "the CPU kernels could not be built (no compiler here?)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must build them: {reason}")
        pytest.skip(reason)
    return built
