"""The state the simulator keeps per replica (``simulator.py`` drives it): the server's own
scheduler and KV manager on the replica's virtual clock, its busy time and KV peak, and
the decode steps priced ahead of time (fleet mode's ``Bulk``, committed or cut later)."""

from __future__ import annotations

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
