"""The discrete-event simulator: our own ``Scheduler``, ``KVCacheManager``, routing
policy and rate limiter, unchanged, on virtual clocks, with a step-cost model in place of
the model.

Events, in time order from one heap:
- ``arrive``: a request reaches the gateway. Its tenant's requests- and tokens-per-minute
  buckets (the gateway's own ``MemoryLimiter`` on the virtual clock) admit it or answer
  429; after auth, limit and safety latencies the routing policy picks a replica (its
  in-flight counts and prefix tree are the real ones).
- ``add``: the request reaches the replica: a real ``Request`` joins that replica's real
  scheduler (arrival, tokenize and queue events on its virtual clock).
- ``step``: the replica runs ``schedule()``; the cost model prices the plan.
- ``done``: that long after, ``update()`` hands out one token per sampling request; those
  that reached their answer length finish (their KV blocks freed and kept in the prefix
  cache, the router told). A conversation's next turn arrives ``think`` seconds after.

Two speeds (``SimConfig.mode``). ``detailed`` runs every step through the scheduler,
every running request in it. ``fleet`` parks each request that only decodes in the
replica's ``DecodeLane`` (``decode_lane.py``): a step counter advances them all, they
get their KV blocks every ``block_size`` steps and their tokens when they finish. The
scheduler plans the rest of each step (prefills, admissions) with the parked decodes'
share of the budget and slots taken out (``schedule(num_parked_decodes=n)``), and a
step that might preempt runs with everyone back in the scheduler. While a replica has
only parked decodes (and nobody who could start: no one waits, no slot is free, or the
cache is too full for the head of the queue), the steps up to the next finish, or as far
as the free blocks go, are one ``bulk`` event, cut after the step in flight by a request
reaching the replica.
Times, steps and cache contents are the detailed mode's.
Finished requests become what a client would have measured (``results.py``).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import random
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from sendpath.bench.client import RequestResult
from sendpath.bench.report import summarize
from sendpath.clock import SettableClock, VirtualClock
from sendpath.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from sendpath.engine.steps import StepShape
from sendpath.errors import QueueFullError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.request import Request, RequestStatus, SamplingParams
from sendpath.router.policy import RoutingPolicy, make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.router.prefix_aware import PrefixAware
from sendpath.router.route import RouteRequest
from sendpath.sim.config import ITL_SAMPLE, MODES, SimConfig, SimResult
from sendpath.sim.cost_model import CostModel
from sendpath.sim.decode_lane import AnswerIds, DecodeLane, beside
from sendpath.sim.replica_state import SimReplica
from sendpath.sim.results import client_view, token_times
from sendpath.sim.tenant_limits import TenantLimits
from sendpath.sim.traffic import SimRequest, Traffic
from sendpath.trace import EventType

__all__ = ["ITL_SAMPLE", "MODES", "SimConfig", "SimResult", "Simulator"]

TOKEN_BASE = 10_000_000  # answers' ids: above any prompt token id


def _text(ids: list[int]) -> str:
    return " ".join(map(str, ids))  # as the gateway routes a token-id prompt


def _settle_gc() -> None:
    """Put what the run made in the collector's oldest generation without a pass over
    it: made with collection off, all of it still counts as young, and the first young
    collection after would walk every survivor (a tenth of a 60,000-request run). Not
    where the caller froze objects of its own (``unfreeze`` would free those too)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class Simulator:
    """Runs traffic through N simulated replicas; one instance per run."""

    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config, self.cost = config, cost
        self._ids = AnswerIds(TOKEN_BASE)  # a sampled token's id, in both modes
        self.replicas = []
        for _ in range(config.replicas):
            clock = SettableClock()
            kv = KVCacheManager(config.num_blocks, config.block_size)
            lane = DecodeLane(kv, self._ids) if config.mode == "fleet" else None
            self.replicas.append(
                SimReplica(clock, kv, Scheduler(config.scheduler, kv, clock), lane=lane)
            )
        self.pool = ReplicaPool(
            [f"sim://replica-{i}" for i in range(config.replicas)], 1 << 30, VirtualClock()
        )
        self.policy: RoutingPolicy = make_policy(config.policy)
        self._texts = isinstance(self.policy, PrefixAware)  # others never read the prompt
        self._tenants = TenantLimits(config)
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._rng = random.Random(0)
        self._inflight: dict[str, tuple[SimRequest, int, float]] = {}  # id -> req, replica, sent
        self._bulk_tokens: dict[str, list[array[float]]] = {}  # id -> token times of its bulks
        self._params: dict[int, SamplingParams] = {}  # by answer length: nobody changes them
        self._finished_count = 0
        self._itl_every = 1
        self.results: list[RequestResult] = []
        self.num_steps = 0
        self.rejected = 0
        self.rate_limited = 0

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self, traffic: Traffic) -> SimResult:
        return self.run_requests(
            traffic.arrivals(), traffic.think_s, traffic.num_requests, traffic.concurrency
        )

    def run_requests(
        self,
        first_turns: Iterable[SimRequest],
        think_s: float = 0.0,
        total: int | None = None,
        concurrency: int | None = None,
    ) -> SimResult:
        """Run first turns given in arrival order (request ids unique); ``total``: how many
        requests to expect, every turn counted (else counted from a list). ``concurrency``:
        a closed loop instead, as `vllm bench serve --max-concurrency` with every request
        ready: that many clients, each sending the next request as its answer ends (the
        turns' own arrival times are not used)."""
        self._think = think_s
        if total is None:
            first_turns = list(first_turns)
            total = sum(1 + len(r.followups) for r in first_turns)
        self._itl_every = max(1, -(-total // ITL_SAMPLE))
        self._feed = iter(first_turns)
        self._closed = concurrency is not None
        if concurrency is None:
            self._next_first(0.0)
        else:
            for _ in range(concurrency):
                self._next_closed(0.0)
        first = self._heap[0][0] if self._heap else 0.0
        end = first
        handlers: dict[str, Callable[[float, Any], None]] = {
            "first": self._first, "arrive": self._arrive, "add": self._add,
            "step": self._step, "done": self._done, "bulk": self._commit,
        }  # fmt: skip
        heap, pop = self._heap, heapq.heappop
        collecting = gc.isenabled()
        gc.disable()  # millions of live objects and no cycles: each full pass cost seconds
        try:
            while heap:
                t, _, kind, payload = pop(heap)
                end = t if t > end else end
                handlers[kind](t, payload)
        finally:
            if collecting:
                _settle_gc()
                gc.enable()
        duration = max(end - first, 1e-9)
        result = SimResult(
            self.results,
            duration,
            [r.busy_s for r in self.replicas],
            [r.kv_peak for r in self.replicas],
            self.num_steps,
            self.rejected,
            self.rate_limited,
        )
        result.report = summarize(self.results, duration)
        return result

    # ---------------------------------------------------------------- events

    def _route(self, req: SimRequest) -> RouteRequest:
        return RouteRequest(_text(req.prompt) if self._texts else "", f"tenant-{req.tenant}",
                            chat=False)  # fmt: skip

    def _next_first(self, after: float) -> None:
        req = next(self._feed, None)
        if req is not None:
            if req.arrival < after:
                raise ValueError("first turns must come in arrival order")
            self._push(req.arrival, "first", req)

    def _next_closed(self, t: float) -> None:
        """A closed loop's client sends its next request at ``t``."""
        req = next(self._feed, None)
        if req is not None:
            req.arrival = t
            self._push(t, "arrive", req)

    def _first(self, t: float, req: SimRequest) -> None:
        """A conversation starts; the next one's arrival joins the heap (one at a time)."""
        self._next_first(t)
        self._arrive(t, req)

    def _arrive(self, t: float, req: SimRequest) -> None:
        config = self.config
        if not self._tenants.allows(t, req):
            self.rate_limited += 1
            self.results.append(RequestResult(error="HTTP 429: rate limited", start=t,
                                              status=429))  # fmt: skip
            if self._closed:  # its client goes on with the next one
                self._next_closed(t)
            return
        route = self._route(req)
        endpoint = self.policy.choose(route, self.pool.endpoints)  # all up, with room
        self.policy.routed(route, endpoint)
        endpoint.in_flight += 1
        reach = t + config.network_rtt_s / 2 + config.gateway_s + config.route_s
        self._push(reach, "add", (req, endpoint.index, t))

    def _add(self, t: float, payload: tuple[SimRequest, int, float]) -> None:
        req, index, sent = payload
        rep = self.replicas[index]
        if rep.bulk is not None:
            self._cut(rep, index, t)
        rep.clock.set(t)
        params = self._params.get(req.output_len)
        if params is None:
            params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
            self._params[req.output_len] = params
        request = Request(
            req.request_id,
            req.prompt,
            params,
            arrival_time=t,
            cache_salt=f"tenant-{req.tenant}",
        )
        request.record(EventType.ARRIVED, t)
        request.record(EventType.TOKENIZED, t)
        try:
            rep.scheduler.add_request(request)
        except QueueFullError:
            self.rejected += 1
            self.pool.endpoints[index].in_flight -= 1
            self.results.append(RequestResult(error="HTTP 503: queue full", start=sent,
                                              status=503))  # fmt: skip
            if self._closed:
                self._next_closed(t)
            return
        self._inflight[req.request_id] = (req, index, sent)
        if not rep.busy:
            rep.busy = True
            self._push(t, "step", index)

    def _step(self, t: float, index: int) -> None:
        """A step starts: the scheduler plans it and the cost model prices it; what it
        produces is applied when it ends (``done``), as the engine's ``update`` is."""
        rep = self.replicas[index]
        rep.clock.set(t)
        lane = rep.lane
        if lane is not None and lane.batch:
            if self._lane_step(rep, lane, index, t):
                return
            self._unpark(rep, lane)
        plan = rep.scheduler.schedule()
        if lane is not None:
            for request_id in plan.preempted:
                lane.forget(request_id)
            lane.order(rep.scheduler.running)
        if plan.is_empty:
            rep.busy = False
            return
        self._price(rep, index, t, plan, StepShape.of(plan))

    def _price(
        self, rep: SimReplica, index: int, t: float, plan: SchedulerOutput, shape: StepShape
    ) -> None:
        seconds = self.cost.step_seconds(shape)
        rep.busy_s += seconds
        self.num_steps += 1
        self._push(t + seconds, "done", (index, plan))

    def _done(self, t: float, payload: tuple[int, SchedulerOutput]) -> None:
        index, plan = payload
        rep = self.replicas[index]
        rep.clock.set(t)
        base = self._ids.base
        sampled = {item.request_id: base + item.start_pos + len(item.token_ids)
                   for item in plan.requests if item.sample}  # fmt: skip
        sched, lane = rep.scheduler, rep.lane
        new = sched.update(plan, RunnerOutput(sampled))
        if lane is not None:  # the parked decodes come first in a step, as in the plan
            lane.ran([t])
            self._finish_parked(rep, lane, index)
        for request, _ in new:
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                sched.finish_request(request.request_id, RequestStatus.FINISHED)
                if lane is not None:
                    lane.forget(request.request_id)
                self._finished(request, index)
        if lane is not None:
            lane.park(sched)
        self._after_step(rep, index)

    def _after_step(self, rep: SimReplica, index: int) -> None:
        usage = rep.kv.usage
        if usage > rep.kv_peak:
            rep.kv_peak = usage
        if rep.scheduler.has_unfinished_requests():
            self._push(rep.clock.now(), "step", index)
        else:
            rep.busy = False

    # ---------------------------------------------------------------- fleet mode

    def _lane_step(self, rep: SimReplica, lane: DecodeLane, index: int, t: float) -> bool:
        """A step beside parked decodes, when it cannot preempt: only they (a bulk up to
        the next finish, or as far as the free blocks go, while nobody else runs or can
        start), or they and the scheduler's plan for the rest."""
        sched = rep.scheduler
        if not sched.running:
            seconds = lane.bulk(self.cost, sched)
            if seconds is not None:
                self._push(rep.start_bulk(t, seconds), "bulk", (index, rep.epoch))
                return True
        if not lane.can_schedule_beside(sched):
            return False
        lane.allocate(1)
        plan = sched.schedule(num_parked_decodes=lane.batch)
        assert not plan.preempted
        lane.order(sched.running)
        self._price(rep, index, t, plan, beside(StepShape.of(plan), lane.batch, lane.context()))
        return True

    def _unpark(self, rep: SimReplica, lane: DecodeLane) -> None:
        for request_id, times in lane.unpark(rep.scheduler).items():
            self._bulk_tokens.setdefault(request_id, []).append(times)

    def _finish_parked(self, rep: SimReplica, lane: DecodeLane, index: int) -> None:
        for request, times in lane.finishing(rep.scheduler, self._continued):
            self._bulk_tokens.setdefault(request.request_id, []).append(times)
            rep.scheduler.finish_request(request.request_id, RequestStatus.FINISHED)
            self._finished(request, index)

    def _continued(self, request_id: str) -> bool:
        """Whether a later turn of the conversation will send this answer back."""
        return bool(self._inflight[request_id][0].followups)

    def _cut(self, rep: SimReplica, index: int, t: float) -> None:
        end = rep.cut_bulk(t)
        if end is not None:
            self._push(end, "bulk", (index, rep.epoch))

    def _commit(self, t: float, payload: tuple[int, int]) -> None:
        """Apply a bulk: the parked decodes' blocks, step by step, and the finishers."""
        index, epoch = payload
        rep = self.replicas[index]
        bulk, lane = rep.take_bulk(epoch), rep.lane
        if bulk is None:
            return  # cut short: a later event commits it
        assert lane is not None
        ends = bulk.ends
        rep.clock.set(ends[-1])
        rep.busy_s += ends[-1] - bulk.start
        self.num_steps += len(ends)
        if len(ends) > 1:  # the cache is fullest before the last step's finishers leave
            lane.allocate(len(ends) - 1)
            lane.ran(ends[:-1])
            rep.kv_peak = max(rep.kv_peak, rep.kv.usage)
        lane.allocate(1)
        lane.ran(ends[-1:])
        self._finish_parked(rep, lane, index)
        self._after_step(rep, index)

    # ---------------------------------------------------------------- results

    def _finished(self, request: Request, index: int) -> None:
        req, _, sent = self._inflight.pop(request.request_id)
        endpoint = self.pool.endpoints[index]
        endpoint.in_flight -= 1
        answer = request.output_token_ids
        if self._texts:
            route = self._route(req)
            self.policy.routed(route.answered(" " + _text(answer)), endpoint)
        self._finished_count += 1
        keep_itl = self._finished_count % self._itl_every == 0
        times = token_times(request, self._bulk_tokens.pop(request.request_id, None))
        self.results.append(client_view(request, sent, self.config, times, keep_itl, req.held))
        now = self.replicas[index].clock.now()
        self._tenants.settle(now, req, request.num_tokens)
        back = now + self.config.network_rtt_s / 2  # the answer reaches its client
        if self._closed:  # who sends the next request
            self._next_closed(back)
        if req.followups:
            think = self._rng.expovariate(1 / self._think) if self._think else 0.0
            nxt = req.next_turn(answer, back + think)
            self._push(nxt.arrival, "arrive", nxt)
