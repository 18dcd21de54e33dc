"""The simulator: the seed's scenarios give the seed's dominant stage; chunked prefill and
prefix-aware routing move the numbers the right way; nothing leaks; runs repeat."""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sendpath.bench.workload import LengthSpec
from sendpath.cli import main
from sendpath.config import SchedulerConfig
from sendpath.sim.calibrated import Calibrated
from sendpath.sim.cost_model import CostModel, Roofline
from sendpath.sim.hardware import hardware, model_spec
from sendpath.sim.results import held_tokens
from sendpath.sim.scenarios import SCENARIOS, simulate
from sendpath.sim.simulator import SimConfig, Simulator
from sendpath.sim.traffic import Traffic
from tests.bench.test_command import VLLM_KEYS
from tests.sim.cases import CHUNKED, mixed_traffic

COST = Roofline(model_spec("llama-3.1-8b"), hardware("H100"))


def test_the_seed_scenarios() -> None:
    quiet = simulate(SCENARIOS["quiet"])[1]
    assert quiet["dominant_stage"] == "decode" and quiet["stages"]["decode"]["share"] > 0.9
    over = SCENARIOS["overloaded"]
    over = replace(over, traffic=replace(over.traffic, num_requests=400))
    overloaded = simulate(over)[1]
    assert overloaded["dominant_stage"] == "queue"
    assert overloaded["simulated"]["utilization"][0] > 0.95
    long_doc = simulate(SCENARIOS["long-document"])[1]
    assert long_doc["stages"]["prefill"]["share"] > 0.3  # a visible share
    assert long_doc["median_ttft_ms"] > 10 * quiet["median_ttft_ms"]
    # no published source ran a 100,000-token prompt: priced, and the answer says so
    (extrapolated,) = long_doc["simulated"]["calibration"]["extrapolated"]
    assert extrapolated.startswith("its longest request holds 100,256 tokens")
    assert quiet["simulated"]["calibration"]["extrapolated"] == []


def test_chunked_prefill_lowers_ttft_p99_under_a_mixed_load() -> None:
    short = Traffic(rate=20, num_requests=400, input_len=LengthSpec(128, 128),
                    output_len=LengthSpec(128, 128), seed=1)  # fmt: skip
    long = Traffic(rate=0.5, num_requests=3, input_len=LengthSpec(30_000, 30_000),
                   output_len=LengthSpec(16, 16), seed=2)  # fmt: skip

    def p99_ttft_of_short(budget: int, cap: int | None = None) -> float:
        longs = long.first_turns()
        for i, r in enumerate(longs):
            r.arrival = 2.0 + 6.0 * i  # one at a time: each prefill runs alone
        requests = short.first_turns() + longs
        for i, r in enumerate(requests):
            r.request_id = f"r{i}"
        requests.sort(key=lambda r: r.arrival)
        sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget,
                                long_prefill_token_threshold=cap)  # fmt: skip
        config = SimConfig(scheduler=sched)
        results = Simulator(config, COST).run_requests(requests).results
        ttfts = [r.ttft for r in results if r.ttft is not None and r.prompt_tokens == 128]
        return float(np.percentile(ttfts, 99))

    # a 30,000-token prompt in one step stalls everyone behind it; chunked (2,048 a step,
    # at most 1,024 of them for one prompt), the short requests that arrive meanwhile start
    # in the next step. Chunks alone do not help their TTFT: the running long prefill
    # would take each step's whole budget before any new request.
    whole = p99_ttft_of_short(32_768)
    assert p99_ttft_of_short(2048, cap=1024) < 0.5 * whole
    assert p99_ttft_of_short(2048) > 0.8 * whole


def test_prefix_aware_beats_round_robin_on_shared_prefixes() -> None:
    traffic = Traffic(
        rate=4, num_requests=240, input_len=LengthSpec(64, 64), output_len=LengthSpec(64, 64),
        shared_prefix=512, turns=4, think_s=2.0,
    )  # fmt: skip
    reports = {}
    for policy in ("round_robin", "prefix_aware"):
        sim = Simulator(SimConfig(replicas=4, policy=policy), COST)
        result = sim.run(traffic)
        hits = sum(r.kv.pool.num_free_blocks for r in sim.replicas)
        assert hits == 4 * SimConfig().num_blocks  # every block free again: nothing leaked
        prompt = sum(rep.kv.num_queries for rep in sim.replicas)
        cached = sum(rep.kv.num_hits for rep in sim.replicas)
        reports[policy] = (cached / prompt, result.report["mean_ttft_ms"])
    assert reports["prefix_aware"][0] > reports["round_robin"][0] + 0.1
    assert reports["prefix_aware"][1] < reports["round_robin"][1]


def test_runs_repeat_and_the_cli_reports_benchs_keys(tmp_path: Path) -> None:
    a = simulate(SCENARIOS["quiet"])[1]
    b = simulate(SCENARIOS["quiet"])[1]
    assert a["mean_e2el_ms"] == b["mean_e2el_ms"] and a["completed"] == 20
    out = tmp_path / "sim.json"
    assert main(["sim", "--scenario", "quiet", "--hardware", "H200", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) >= VLLM_KEYS and report["simulated"]["hardware"] == "H200-SXM"
    assert report["simulated"]["usd_per_1m_output_tokens"] > 0
    assert main(["sim", "--model", "llama-3.1-70b", "--hardware", "L4"]) == 2  # does not fit
    assert main(["sim", "--model", "Llama-3.1-70B", "--hardware", "l4"]) == 2  # any case
    closed = tmp_path / "closed.json"
    argv = ["sim", "--requests", "8", "--max-concurrency", "1", "--json", str(closed)]
    assert main(argv) == 0  # one client: each request alone, so no queueing at all
    alone = json.loads(closed.read_text())
    assert alone["completed"] == 8 and alone["stages"]["engine.queue"]["mean_ms"] < 1


# a CPU-like calibrated model: no bulk pricing of its own, decodes padded to the longest
CALIBRATED = Calibrated(
    {"step": 0.04, "prompt": 0.0015, "context": 1e-9, "kv": 1e-5, "decode": 0.002}
)


def counted_schedules(sim: Simulator) -> list[int]:
    """Every replica's ``schedule`` calls from now on (their ``num_parked_decodes``)."""
    calls: list[int] = []
    for rep in sim.replicas:

        def counted(num_parked_decodes: int = 0, real: Any = rep.scheduler.schedule) -> Any:
            calls.append(num_parked_decodes)
            return real(num_parked_decodes)

        rep.scheduler.schedule = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("cost", [COST, CALIBRATED], ids=["roofline", "calibrated"])
def test_fleet_mode_gives_the_detailed_modes_answers_with_fewer_scheduler_calls(
    cost: CostModel,
) -> None:
    traffic = mixed_traffic(300)
    # a cache small enough that requests are preempted now and then, and prompts chunked
    for num_blocks, sched in ((20_000, SimConfig().scheduler), (400, SimConfig().scheduler),
                              (20_000, CHUNKED), (600, CHUNKED)):  # fmt: skip
        runs = {}
        for mode in ("detailed", "fleet"):
            config = SimConfig(replicas=3, num_blocks=num_blocks, mode=mode,
                               policy="prefix_aware", scheduler=sched)  # fmt: skip
            sim = Simulator(config, cost)
            calls = counted_schedules(sim)
            result = sim.run(traffic)
            assert all(r.kv.pool.num_free_blocks == num_blocks for r in sim.replicas)
            by_id = {r.request_id: (r.ttft, r.latency, r.itl, r.timings) for r in result.results}
            runs[mode] = (by_id, result.num_steps, len(calls), result.busy, result.kv_peak)
        detailed, fleet = runs["detailed"], runs["fleet"]
        assert len(detailed[0]) == 300
        for request_id, (ttft, latency, itl, timings) in detailed[0].items():
            f_ttft, f_latency, f_itl, f_timings = fleet[0][request_id]
            assert f_ttft == pytest.approx(ttft, abs=1e-9)
            assert f_latency == pytest.approx(latency, abs=1e-9)
            assert f_itl == pytest.approx(itl, abs=1e-9)
            assert f_timings == pytest.approx(timings, abs=1e-6)  # the stages too
        assert fleet[1] == detailed[1]  # the same steps, priced the same
        assert fleet[3] == pytest.approx(detailed[3])
        assert fleet[4] == detailed[4]  # the peak KV usage
        # most steps without the scheduler; a full cache needs it step by step (preemptions)
        assert fleet[2] < detailed[2] / (3 if num_blocks == 20_000 else 1)
        assert all(rep.lane is not None and not rep.lane.batch for rep in sim.replicas)


# every request at once (an offline benchmark's batch) into a cache it outgrows
PAST_THE_CACHE = {
    # short prompts, long answers: the running batch outgrows the cache as it decodes
    "long answers": (Traffic(rate=1e6, num_requests=40, input_len=LengthSpec(16, 64),
                             output_len=LengthSpec(200, 400), seed=3),
                     SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)),
    # long chunked prompts: a few fit, and the head of the queue, preempted, waits with
    # its own blocks cached and free until the decodes have taken enough of them
    "long prompts": (Traffic(rate=1e6, num_requests=30, input_len=LengthSpec(300, 500),
                             output_len=LengthSpec(100, 250), shared_prefix=32, seed=4),
                     SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)),
}  # fmt: skip


@pytest.mark.parametrize("workload", PAST_THE_CACHE)
def test_fleet_mode_runs_a_batch_past_the_caches_size_in_bulks(workload: str) -> None:
    # the parked decodes run in bulks as far as the free blocks go and until the head of
    # the queue could start; the scheduler steps in where it must preempt or admit
    traffic, sched = PAST_THE_CACHE[workload]
    runs = {}
    for mode in ("detailed", "fleet"):
        config = SimConfig(num_blocks=150, mode=mode, scheduler=sched)
        sim = Simulator(config, COST)
        calls = counted_schedules(sim)
        result = sim.run(traffic)
        runs[mode] = ({r.request_id: (r.ttft, r.latency, r.itl) for r in result.results},
                      result.num_steps, result.kv_peak, sim.replicas[0].scheduler.num_preemptions,
                      len(calls))  # fmt: skip
    detailed, fleet = runs["detailed"], runs["fleet"]
    assert len(detailed[0]) == traffic.num_requests and detailed[3] > 0  # it ran out
    for request_id, (ttft, latency, itl) in detailed[0].items():
        f_ttft, f_latency, f_itl = fleet[0][request_id]
        assert (f_ttft, f_latency) == pytest.approx((ttft, latency), abs=1e-9)
        assert f_itl == pytest.approx(itl, abs=1e-9)
    assert fleet[1:4] == detailed[1:4]  # the same steps, KV peak and preemptions
    assert fleet[4] < detailed[4] / 3


def test_fleet_mode_keeps_the_running_order_when_a_later_prompt_finishes_first() -> None:
    # tiny blocks, a tight cache, chunked prompts of mixed lengths and shared prefixes:
    # requests finishing in one step free their blocks in running (admission) order, and
    # that order decides what the cache evicts later. Parking a request when its prompt
    # is done instead of keeping its admission order changes 26 of these answers.
    traffic = Traffic(rate=20, num_requests=200, input_len=LengthSpec(8, 200),
                      output_len=LengthSpec(4, 60), shared_prefix=16, turns=3, think_s=0.5,
                      seed=13)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                            long_prefill_token_threshold=24)  # fmt: skip
    runs = {}
    for mode in ("detailed", "fleet"):
        config = SimConfig(num_blocks=300, block_size=4, mode=mode, scheduler=sched)
        result = Simulator(config, COST).run(traffic)
        runs[mode] = {r.request_id: (r.ttft, r.latency) for r in result.results}
    assert len(runs["detailed"]) == 200
    for request_id, (ttft, latency) in runs["detailed"].items():
        assert runs["fleet"][request_id] == pytest.approx((ttft, latency), abs=1e-9)


def test_fleet_mode_records_the_first_token_of_a_prompt_whose_last_chunk_is_one_token() -> None:
    # a 64-token budget leaves a 65-token prompt's last token for the next step, where it
    # decodes like any running request: the stages still say when the prefill ended
    traffic = Traffic(rate=2, num_requests=50, input_len=LengthSpec(65, 65),
                      output_len=LengthSpec(20, 20), seed=1)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64)
    runs = {}
    for mode in ("detailed", "fleet"):
        config = SimConfig(mode=mode, scheduler=sched)
        runs[mode] = {r.request_id: r.timings for r in Simulator(config, COST).run(traffic).results}
    assert runs["detailed"]["s0-0"]["decode"] > 0
    for request_id, timings in runs["detailed"].items():
        assert runs["fleet"][request_id] == pytest.approx(timings, abs=1e-6)


def test_diurnal_traffic_peaks_at_midday_with_the_mean_rate() -> None:
    one = LengthSpec(1, 1)
    day = Traffic(rate=2.0, num_requests=20_000, pattern="diurnal", period_s=10_000,
                  peak_ratio=4.0, output_len=one, input_len=one)  # fmt: skip
    times = np.array([r.arrival for r in day.arrivals()])
    assert times[-1] == pytest.approx(10_000, rel=0.05)  # 20,000 at a mean of 2/s
    hours = np.histogram(times % 10_000, bins=10, range=(0, 10_000))[0]
    trough = (hours[0] + hours[-1]) / 2
    peak = (hours[4] + hours[5]) / 2
    assert 3.0 < peak / trough < 4.5
    assert day.rate_at(5_000) == pytest.approx(2.0 * 1.6) and day.rate_at(0) == pytest.approx(0.8)


def test_a_tenant_over_its_tokens_per_minute_gets_429s_and_the_rest_are_served() -> None:
    # two tenants alternate; each sends 30 requests/min of 100 + 50 tokens = 4,500 tokens/min
    traffic = Traffic(rate=1.0, num_requests=240, input_len=LengthSpec(100, 100),
                      output_len=LengthSpec(50, 50), tenants=2)  # fmt: skip
    limited = Simulator(SimConfig(tpm=3_000), COST).run(traffic)
    ok = [r for r in limited.results if r.success]
    assert limited.rate_limited == sum(1 for r in limited.results if r.status == 429) > 0
    assert len(ok) + limited.rate_limited == 240
    minutes = limited.duration / 60
    # admitted tokens: at most each tenant's minute allowance, refilled
    assert sum((r.prompt_tokens or 0) + r.output_tokens for r in ok) <= 2 * 3_000 * (minutes + 1)
    assert len(ok) > 0.5 * 240 * 3_000 / 4_500
    unlimited = Simulator(SimConfig(), COST).run(traffic)
    assert unlimited.rate_limited == 0 and len(unlimited.results) == 240


def test_first_turns_must_come_in_arrival_order() -> None:
    requests = Traffic(rate=5, num_requests=3).first_turns()
    with pytest.raises(ValueError, match="arrival order"):
        Simulator(SimConfig(), COST).run_requests(reversed(requests), total=3)


def test_a_held_first_token_reaches_the_client_with_the_next() -> None:
    traffic = Traffic(rate=4, num_requests=40, input_len=LengthSpec(64, 256),
                      output_len=LengthSpec(4, 32), seed=3)  # fmt: skip
    plain = {r.request_id: r for r in Simulator(SimConfig(), COST).run(traffic).results}
    held = Simulator(SimConfig(first_token_hold=(0.0, 0.0, 1.0)), COST).run(traffic).results
    for r in held:  # two more tokens: the first event comes with the third token
        p = plain[r.request_id]
        assert r.ttft is not None and p.ttft is not None
        assert r.ttft == pytest.approx(p.ttft + p.itl[0] + p.itl[1])
        assert r.itl == pytest.approx(p.itl[2:]) and r.latency == pytest.approx(p.latency)
    # a replayed request's own hold, where known, instead of the drawn one
    own = [replace(r, held=i % 2) for i, r in enumerate(traffic.first_turns())]
    holds = {r.request_id: r.held for r in own}
    config = SimConfig(first_token_hold=(0.0, 0.0, 1.0))
    for r in Simulator(config, COST).run_requests(own).results:
        p, k = plain[r.request_id], holds[str(r.request_id)] or 0
        assert r.ttft is not None and p.ttft is not None
        assert r.ttft == pytest.approx(p.ttft + sum(p.itl[:k]))
        assert r.itl == pytest.approx(p.itl[k:]) and r.latency == pytest.approx(p.latency)
    # more than the answer has: its first token comes with its last; a conversation's next
    # turn is a new request, whose hold is drawn (two tokens here)
    talk = replace(traffic, num_requests=20, turns=2)
    first = [replace(r, held=99) for r in talk.first_turns()]
    config = SimConfig(first_token_hold=(0.0, 0.0, 1.0))
    for r in Simulator(config, COST).run_requests(first, total=20).results:
        assert r.ttft is not None and r.request_id is not None
        if r.request_id.endswith("-0"):
            assert not len(r.itl) and r.ttft == pytest.approx(r.latency)
        else:
            assert len(r.itl) == r.output_tokens - 3  # the first token came with the third
    # the share held h tokens is drawn per request id, in the shares given
    shares = (0.7, 0.2, 0.1)
    drawn = [held_tokens(f"r{i}", shares) for i in range(20_000)]
    assert [drawn.count(h) / len(drawn) for h in range(3)] == pytest.approx(shares, abs=0.01)
    assert drawn == [held_tokens(f"r{i}", shares) for i in range(20_000)]
    few = [held_tokens(f"r{i}", (1 / 16, 15 / 16)) for i in range(1000)]  # ids a digit apart
    assert few.count(0) / 1000 == pytest.approx(1 / 16, abs=0.012)
    with pytest.raises(ValueError, match="add up to 1"):
        SimConfig(first_token_hold=(0.5, 0.2))


def test_a_closed_loop_keeps_its_clients_busy_and_no_more() -> None:
    """`concurrency`: each client sends its next request when its answer ends."""
    traffic = Traffic(rate=1.0, num_requests=12, input_len=LengthSpec(64, 64),
                      output_len=LengthSpec(16, 16), concurrency=3)  # fmt: skip
    config = SimConfig(network_rtt_s=0.0)
    results = Simulator(config, COST).run(traffic).results
    assert len(results) == 12 and all(r.success for r in results)
    spans = sorted((r.start, r.start + r.latency) for r in results)
    assert [start for start, _ in spans[:3]] == [0.0, 0.0, 0.0]
    for start, _ in spans:  # never more than 3 in flight at once
        assert sum(1 for s, e in spans if s <= start < e) <= 3
    ends = sorted(e for _, e in spans)
    assert sorted(s for s, _ in spans[3:]) == pytest.approx(ends[:9])  # one starts as one ends
    with pytest.raises(ValueError, match="closed loop"):
        Traffic(rate=1.0, num_requests=4, concurrency=0)


def test_a_run_leaves_the_collector_on_and_the_callers_frozen_objects_frozen() -> None:
    traffic = Traffic(rate=5, num_requests=20)
    Simulator(SimConfig(), COST).run(traffic)
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the run's objects not frozen
    kept = [object() for _ in range(3)]  # a caller's, frozen (as a forking server does)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        Simulator(SimConfig(), COST).run(traffic)
        # none unfrozen, none of the run's added (a frozen object that dies leaves)
        assert gc.isenabled() and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    assert kept
