"""The discrete-event simulator: our own ``Scheduler``, ``KVCacheManager`` and routing
policy, unchanged, on virtual clocks, with a step-cost model in place of the model.

Events, in time order from one heap:
- ``arrive``: a request reaches the gateway. After the gateway's latency the routing
  policy picks a replica (its in-flight counts and prefix tree are the real ones).
- ``add``: the request reaches the replica: a real ``Request`` joins that replica's real
  scheduler (arrival, tokenize and queue events on its virtual clock).
- ``step``: the replica runs ``schedule()``; the cost model prices the plan; the
  replica's clock moves on by that much; ``update()`` hands out one token per sampling
  request; those that reached their answer length finish (their KV blocks freed and kept
  in the prefix cache). A conversation's next turn arrives ``think`` seconds after.

Each finished request becomes a ``RequestResult`` as a client would have measured it
(network and gateway latencies added), so `sendpath sim` reports with the same keys and
definitions as `sendpath bench`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from sendpath.bench.client import RequestResult
from sendpath.bench.report import summarize
from sendpath.clock import VirtualClock
from sendpath.config import SchedulerConfig
from sendpath.engine.scheduler import RunnerOutput, Scheduler
from sendpath.errors import QueueFullError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.request import Request, RequestStatus, SamplingParams
from sendpath.router.policy import RouteRequest, RoutingPolicy, make_policy
from sendpath.router.pool import ReplicaPool
from sendpath.sim.cost_model import CostModel, StepShape
from sendpath.sim.traffic import SimRequest, Traffic
from sendpath.trace import EventType, Stage

__all__ = ["SimConfig", "SimResult", "Simulator"]


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 1
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    )
    num_blocks: int = 20_000
    block_size: int = 16
    policy: str = "round_robin"
    network_rtt_s: float = 0.02  # client <-> gateway, both ways
    gateway_s: float = 0.0005  # auth + limits + safety
    route_s: float = 0.0005  # gateway -> replica hop and routing decision


@dataclass
class SimResult:
    results: list[RequestResult]
    duration: float  # virtual seconds from the first arrival to the last answer
    busy: list[float]  # per replica: virtual seconds spent in steps
    kv_peak: list[float]  # per replica: the highest KV-cache usage seen
    num_steps: int
    rejected: int = 0
    report: dict[str, Any] = field(default_factory=dict)


class _ReplicaClock:
    """A replica's virtual time. Events come in time order, but a step moves the clock
    to its end at once; a request that arrives during that step is queued at its own
    arrival time, so the clock is set, not only advanced."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        self.t = t


@dataclass
class _Replica:
    clock: _ReplicaClock
    kv: KVCacheManager
    scheduler: Scheduler
    busy: bool = False
    busy_s: float = 0.0
    kv_peak: float = 0.0


def _text(ids: list[int]) -> str:
    return "".join(f"{i} " for i in ids)


class Simulator:
    """Runs traffic through N simulated replicas; one instance per run."""

    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config, self.cost = config, cost
        self.replicas = []
        for _ in range(config.replicas):
            clock = _ReplicaClock()
            kv = KVCacheManager(config.num_blocks, config.block_size)
            self.replicas.append(_Replica(clock, kv, Scheduler(config.scheduler, kv, clock)))
        self.pool = ReplicaPool(
            [f"sim://replica-{i}" for i in range(config.replicas)], 1 << 30, VirtualClock()
        )
        self.policy: RoutingPolicy = make_policy(config.policy)
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._inflight: dict[str, tuple[SimRequest, int, float]] = {}  # id -> req, replica, sent
        self._rng = random.Random(0)
        self.results: list[RequestResult] = []
        self.num_steps = 0
        self.rejected = 0

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self, traffic: Traffic) -> SimResult:
        return self.run_requests(traffic.first_turns(), traffic.think_s)

    def run_requests(self, first_turns: list[SimRequest], think_s: float = 0.0) -> SimResult:
        """Run given first turns (request ids must be unique)."""
        self._think = think_s
        for r in first_turns:
            self._push(r.arrival, "arrive", r)
        first = self._heap[0][0] if self._heap else 0.0
        end = first
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            end = max(end, t)
            if kind == "arrive":
                self._arrive(t, payload)
            elif kind == "add":
                self._add(t, *payload)
            else:
                self._step(t, payload)
        duration = max(end - first, 1e-9)
        result = SimResult(
            self.results,
            duration,
            [r.busy_s for r in self.replicas],
            [r.kv_peak for r in self.replicas],
            self.num_steps,
            self.rejected,
        )
        result.report = summarize(self.results, duration)
        return result

    # ---------------------------------------------------------------- events

    def _arrive(self, t: float, req: SimRequest) -> None:
        route = RouteRequest(_text(req.prompt), f"tenant-{req.tenant}", chat=False)
        candidates = self.pool.candidates()
        endpoint = self.policy.choose(route, candidates)
        self.policy.routed(route, endpoint)
        endpoint.in_flight += 1
        reach = t + self.config.network_rtt_s / 2 + self.config.gateway_s + self.config.route_s
        self._push(reach, "add", (req, endpoint.index, t))

    def _add(self, t: float, req: SimRequest, index: int, sent: float) -> None:
        rep = self.replicas[index]
        rep.clock.set(t)
        request = Request(
            req.request_id,
            req.prompt,
            SamplingParams(max_tokens=req.output_len, ignore_eos=True),
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
            self.results.append(RequestResult(error="HTTP 503: queue full", start=sent))
            return
        self._inflight[req.request_id] = (req, index, sent)
        if not rep.busy:
            rep.busy = True
            self._push(t, "step", index)

    def _step(self, t: float, index: int) -> None:
        rep = self.replicas[index]
        rep.clock.set(t)
        plan = rep.scheduler.schedule()
        if plan.is_empty:
            rep.busy = False
            return
        seconds = self.cost.step_seconds(StepShape.of(plan))
        rep.clock.set(t + seconds)
        rep.busy_s += seconds
        self.num_steps += 1
        sampled = {item.request_id: 1 + self._rng.randrange(30000) for item in plan.requests
                   if item.sample}  # fmt: skip
        for request, _ in rep.scheduler.update(plan, RunnerOutput(sampled)):
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                rep.scheduler.finish_request(request.request_id, RequestStatus.FINISHED)
                self._finished(request, index)
        rep.kv_peak = max(rep.kv_peak, rep.kv.usage)
        if rep.scheduler.has_unfinished_requests():
            self._push(rep.clock.now(), "step", index)
        else:
            rep.busy = False

    def _finished(self, request: Request, index: int) -> None:
        req, _, sent = self._inflight.pop(request.request_id)
        endpoint = self.pool.endpoints[index]
        endpoint.in_flight -= 1
        answer = request.output_token_ids
        route = RouteRequest(_text(req.prompt), f"tenant-{req.tenant}", chat=False)
        self.policy.routed(route.answered(_text(answer)), endpoint)
        self.results.append(self._client_view(request, sent))
        if req.followups:
            question, out_len = req.followups[0]
            nxt = SimRequest(
                f"s{req.session}-{req.turn + 1}",
                0.0,
                req.prompt + answer + question,
                out_len,
                req.session,
                req.turn + 1,
                req.tenant,
                req.followups[1:],
            )
            back = self.replicas[index].clock.now() + self.config.network_rtt_s / 2
            nxt.arrival = back + (self._rng.expovariate(1 / self._think) if self._think else 0)
            self._push(nxt.arrival, "arrive", nxt)

    def _client_view(self, request: Request, sent: float) -> RequestResult:
        """What a client would have measured, with the stages the server would report."""
        tl = request.timeline
        half = self.config.network_rtt_s / 2
        tokens = tl.token_times
        stages = tl.stages()
        gateway_ms = self.config.gateway_s * 1000
        timings = {
            Stage.GATEWAY_AUTH.value: gateway_ms / 3,
            Stage.GATEWAY_RATELIMIT.value: gateway_ms / 3,
            Stage.GATEWAY_SAFETY.value: gateway_ms / 3,
            Stage.GATEWAY_QUEUE.value: 0.0,
            Stage.ROUTE.value: self.config.route_s * 1000,
        }
        for stage in (Stage.TOKENIZE, Stage.ENGINE_QUEUE, Stage.PREFILL, Stage.DECODE):
            timings[stage.value] = stages.get(stage, 0.0) * 1000
        timings[Stage.STREAM.value] = 0.0
        end = (tl.end or tokens[-1]) + half
        timings["total"] = sum(timings.values())  # the server's part; network is the rest
        return RequestResult(
            success=True,
            request_id=request.request_id,
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=len(request.output_token_ids),
            ttft=tokens[0] + half - sent,
            itl=tl.itls,
            latency=end - sent,
            start=sent,
            finish_reason="length",
            timings=timings,
        )
