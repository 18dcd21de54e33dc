"""The simulator: the seed's scenarios give the seed's dominant stage; chunked prefill and
prefix-aware routing move the numbers the right way; nothing leaks; runs repeat."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from sendpath.bench.workload import LengthSpec
from sendpath.cli import main
from sendpath.config import SchedulerConfig
from sendpath.sim.cost_model import Roofline
from sendpath.sim.hardware import hardware, model_spec
from sendpath.sim.scenarios import SCENARIOS, simulate
from sendpath.sim.simulator import SimConfig, Simulator
from sendpath.sim.traffic import Traffic
from tests.bench.test_command import VLLM_KEYS

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


def test_chunked_prefill_lowers_ttft_p99_under_a_mixed_load() -> None:
    short = Traffic(rate=20, num_requests=400, input_len=LengthSpec(128, 128),
                    output_len=LengthSpec(128, 128), seed=1)  # fmt: skip
    long = Traffic(rate=0.5, num_requests=3, input_len=LengthSpec(30_000, 30_000),
                   output_len=LengthSpec(16, 16), seed=2)  # fmt: skip

    def p99_ttft_of_short(budget: int, cap: int | None = None) -> float:
        requests = short.first_turns() + long.first_turns()
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
