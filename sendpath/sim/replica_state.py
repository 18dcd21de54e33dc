"""The state the simulator keeps per replica (``simulator.py`` drives it): the server's own
scheduler and KV manager on the replica's virtual clock, its busy time and KV peak, and
the decode steps priced ahead of time (fleet mode's ``Bulk``, committed or cut later)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from sendpath.clock import SettableClock
from sendpath.engine.scheduler import Scheduler
from sendpath.kvcache.manager import KVCacheManager
from sendpath.sim.decode_lane import DecodeLane

__all__ = ["Bulk", "SimReplica"]


@dataclass
class Bulk:
    """Decode steps priced ahead: they end at ``ends``; not applied until committed."""

    start: float
    ends: list[float]
    epoch: int  # the replica's bulk counter when scheduled: a cut bulk's old event is stale


@dataclass
class SimReplica:
    """One simulated replica: its own clock, KV cache and scheduler (the server's code),
    whether it is stepping, what it has used, and its decode steps priced ahead."""

    clock: SettableClock
    kv: KVCacheManager
    scheduler: Scheduler
    busy: bool = False
    busy_s: float = 0.0
    kv_peak: float = 0.0
    bulk: Bulk | None = None
    epoch: int = 0
    lane: DecodeLane | None = None  # the fleet mode's parked decodes

    def start_bulk(self, t: float, seconds: list[float]) -> float:
        """Decode steps of these lengths from ``t`` priced ahead; when the last ends."""
        self.epoch += 1
        ends = itertools.islice(itertools.accumulate(seconds, initial=t), 1, None)
        self.bulk = Bulk(t, list(ends), self.epoch)
        return self.bulk.ends[-1]

    def cut_bulk(self, t: float) -> float | None:
        """A request reached the replica at ``t``: the bulk stops after the step in
        flight. When it now ends, or None where that was its last step anyway."""
        bulk = self.bulk
        assert bulk is not None
        keep = bisect.bisect_left(bulk.ends, t) + 1
        if keep >= len(bulk.ends):
            return None
        del bulk.ends[keep:]
        self.epoch += 1
        bulk.epoch = self.epoch
        return bulk.ends[-1]

    def take_bulk(self, epoch: int) -> Bulk | None:
        """The bulk to commit for an event of ``epoch``; None where it was cut since (a
        later event commits it)."""
        bulk = self.bulk
        if bulk is None or bulk.epoch != epoch:
            return None
        self.bulk = None
        return bulk
