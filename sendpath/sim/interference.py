"""Whether other processes used the CPU while a step was being timed.

On a small machine one busy neighbour slows torch's threads several-fold (a thread that
waits at a barrier for a descheduled sibling loses a whole time slice), and the median of
a handful of steps does not hide a neighbour that runs for a minute. So the profiler asks,
for each timed step, how much CPU the rest of the machine used meanwhile: the machine's
busy time (``/proc/stat``) minus this process's (``time.process_time``). A step is clean
when the others used at most ``SHARE`` of its wall time plus ``TICKS`` clock ticks
(``/proc/stat`` counts in ticks of 10 ms: an idle machine reads within about a tick).
Without ``/proc/stat`` (not Linux) every step counts as clean.
"""

from __future__ import annotations

import os
import time

__all__ = ["SHARE", "TICKS", "Interference"]

SHARE = 0.1
TICKS = 2
POLL_S = 0.5  # window over which ``wait`` looks for a quiet machine


class Interference:
    """Measures other processes' CPU use; ``wait`` spends at most ``wait_budget_s`` in all."""

    def __init__(self, wait_budget_s: float = 120.0) -> None:
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self.wait_left_s = wait_budget_s
        self.available = self._busy_s() is not None

    def _busy_s(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        return (sum(ticks[:8]) - ticks[3] - ticks[4]) * self.tick_s

    def others_s(self) -> float:
        """A running total of the CPU seconds used by everything but this process."""
        busy = self._busy_s()
        return 0.0 if busy is None else busy - time.process_time()

    def clean(self, wall_s: float, others_s: float) -> bool:
        """Whether ``others_s`` CPU seconds used during ``wall_s`` leave a step's time intact."""
        return others_s <= SHARE * wall_s + TICKS * self.tick_s

    def wait(self) -> None:
        """Wait until the others are quiet for ``POLL_S``, or the wait budget is spent."""
        while self.available and self.wait_left_s > 0:
            before, start = self.others_s(), time.perf_counter()
            time.sleep(POLL_S)
            wall = time.perf_counter() - start
            self.wait_left_s -= wall
            if self.clean(wall, self.others_s() - before):
                return
