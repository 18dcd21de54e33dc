"""Clocks: the one source of time for the engine, the gateway and the simulator.

Code that measures or schedules takes a ``Clock`` instead of calling ``time`` itself, so the
same scheduler runs against wall time in the server and against virtual time in the simulator.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "RealClock", "SettableClock", "VirtualClock"]


class Clock(Protocol):
    """Monotonic seconds; only differences between two readings mean anything."""

    def now(self) -> float: ...


class RealClock:
    """Wall time from ``time.perf_counter``."""

    def now(self) -> float:
        return time.perf_counter()


class VirtualClock:
    """Time that moves only when told to (tests, the simulator)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; time never goes back."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (advance by {seconds})")
        self._now += seconds


class SettableClock:
    """A simulated replica's time. Events come in time order, but a step moves the clock
    to its end at once; a request that arrives during that step is queued at its own
    arrival time, so the clock is set, not only advanced."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        self.t = t
