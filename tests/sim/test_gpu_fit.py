"""Fitting the GPU step model to published figures: replayable measurements become the
simulator's runs, the others say why not; the fit finds terms that made the figures and
is deterministic."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from sendpath.sim.gpu_fit import (
    REPORT_KEYS,
    Unreplayable,
    case,
    cases,
    errors,
    fit,
    mean_error,
    predict,
)
from sendpath.sim.gpu_model import Efficiency
from sendpath.sim.gpu_sources import FIGURES, Measurement, Setup, Source, Workload, load_sources

SETUP = Setup("Llama-3.1-8B-Instruct", 8.03, "bf16", "H100-SXM-80GB", 1, 1)


def source(*measurements: Measurement, setup: Setup = SETUP) -> Source:
    return Source("s", "t", "https://example.org", "p", "blog", "2024-01-01", "vLLM", "0.6.0",
                  setup, measurements)  # fmt: skip


def measurement(
    name: str, rate: float | None, figures: dict[str, float], **w: object
) -> Measurement:
    workload = Workload("random", 512, 64, 60, rate, None, rate is None)
    return Measurement(name, replace(workload, **w), figures, "quoted")  # type: ignore[arg-type]


def test_a_measurement_replays_as_its_source_ran_it() -> None:
    m = measurement("r4", 4.0, {"tpot_p50_ms": 10.0})
    c = case(source(m), m)
    assert c.model.name == "Llama-3.1-8B" and c.hw.name == "H100-SXM"
    assert c.traffic.rate == 4.0 and c.traffic.num_requests == 60
    assert c.traffic.input_len.mean == 512 and c.config.replicas == 1
    assert c.config.network_rtt_s == 0 and c.config.scheduler.max_num_batched_tokens == 8192
    tp2 = replace(SETUP, gpu_count=4, tp=2, model="Llama-2-70b-hf", params_b=69.0)
    c2 = case(source(m, setup=tp2), m)
    assert c2.model.name == "Llama-2-70B" and c2.config.replicas == 2
    closed = measurement("c16", 2.0, {"tpot_p50_ms": 10.0}, request_rate=None, concurrency=16,
                         num_prompts=None)  # fmt: skip
    c3 = case(source(closed), closed)
    assert c3.traffic.concurrency == 16 and c3.traffic.num_requests == 160  # ten rounds
    batch = replace(closed, workload=replace(closed.workload, offline=True))
    c4 = case(source(batch), batch)  # a static batch of 16, all at once
    assert c4.traffic.concurrency is None and c4.traffic.num_requests == 16
    lmdeploy = replace(SETUP, model="LLaMA v3.1 70B", params_b=70.6, gpu="A100-80G", gpu_count=4)
    assert case(source(m, setup=replace(lmdeploy, tp=4)), m).model.name == "Llama-3.1-70B"


def test_a_replay_takes_the_known_batch_limits_and_says_how_each_is_known() -> None:
    m = measurement("r4", 4.0, {"tpot_p50_ms": 10.0})
    assert case(source(m), m).limits == {
        "max_num_seqs": "256 (assumed)",
        "max_num_batched_tokens": "8192 (assumed)",
    }
    known = replace(
        SETUP,
        max_num_seqs=2048,
        max_num_batched_tokens=4096,
        engine_defaults=("max_num_seqs",),
        engine_defaults_from="release notes",
    )
    c = case(source(m, setup=known), m)
    assert c.config.scheduler.max_num_seqs == 2048
    assert c.config.scheduler.max_num_batched_tokens == 4096
    assert c.limits == {
        "max_num_seqs": "2048 (engine default)",
        "max_num_batched_tokens": "4096 (stated)",
    }


@pytest.mark.parametrize(
    ("setup", "workload", "reason"),
    [
        ({}, {"dataset": "sharegpt", "input_len": None}, "without stated lengths"),
        ({"model": "Mixtral-8x7B"}, {}, "not a Llama 2 or 3"),
        ({"gpu": "MI300X"}, {}, "not one of H200, H100, A100, L4"),
        ({"gpu_count": 3, "tp": 2}, {}, "not whole replicas"),
        ({"model": "Llama-3.1-70B", "params_b": 70.6, "gpu": "L4"}, {}, "does not fit"),
    ],
)
def test_what_cannot_be_replayed_says_why(
    setup: dict[str, object], workload: dict[str, object], reason: str
) -> None:
    m = measurement("x", 2.0, {"tpot_p50_ms": 10.0}, **workload)
    with pytest.raises(Unreplayable, match=reason):
        case(source(m, setup=replace(SETUP, **setup)), m)  # type: ignore[arg-type]
    found, skipped = cases([source(m, setup=replace(SETUP, **setup))])  # type: ignore[arg-type]
    assert found == [] and skipped[0][0] == "s/x" and reason in skipped[0][1]


def test_the_fit_finds_the_terms_that_made_the_figures_and_is_deterministic() -> None:
    truth = Efficiency(compute=0.6, half_tokens=256.0, memory=0.7, step_s=0.004, seq_s=0.0)
    made = []
    loads = (("offline", None, 512, 64), ("r2", 2.0, 512, 64), ("prompts", None, 3000, 4))
    for name, rate, prompt, answer in loads:
        figures = {"output_throughput_tok_s": 1.0, "tpot_p50_ms": 1.0, "ttft_p50_ms": 1.0}
        m = measurement(name, rate, figures, input_len=prompt, output_len=answer)
        m = replace(m, figures=predict(case(source(m), m, 40), truth))  # what truth gives
        made.append(case(source(m), m, 40))
    assert mean_error(made, truth) == 0.0 and max(errors(made[0], truth).values()) == 0.0
    grid: dict[str, tuple[float, ...]] = {
        "compute": (0.4, 0.6),
        "half_tokens": (0.0, 256.0),
        "memory": (0.7, 0.9),
        "step_s": (0.001, 0.004),
    }
    first = fit(made, Efficiency(), grid)
    assert first == fit(made, Efficiency(), grid)  # the same cases, the same terms
    eff, error = first
    assert error == 0.0 and eff == truth


def test_every_published_figure_has_a_prediction() -> None:
    """Each figure a source may print is one the replay reports; with every answer the
    same length, the mean inter-token gap is the mean TPOT (each request's gaps are as
    many), which is how a table's 'Mean ITL' compares."""
    assert set(REPORT_KEYS) == set(FIGURES)
    m = measurement("r8", 8.0, dict.fromkeys(FIGURES, 1.0), output_len=32)
    got = predict(case(source(m), m, 40), Efficiency())
    assert set(got) == set(FIGURES) and all(v > 0 for v in got.values())  # each reported
    assert got["itl_mean_ms"] == pytest.approx(got["tpot_mean_ms"], rel=1e-9)


def test_the_shipped_calibration_replayed_each_source_with_its_files_limits() -> None:
    """benchmarks/results/gpu_calibration.json was made from the sources as they are: a
    source's limits edited since would make its published table stale."""
    results = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu_calibration.json"
    rows = json.loads(results.read_text())["rows"]
    limits = {c.name: c.limits for c in cases(load_sources())[0]}
    assert rows and {r["case"] for r in rows} == set(limits)
    assert all(r["limits"] == limits[r["case"]] for r in rows)
    tp8 = next(r for r in rows if "h100x8-128-4096" in r["case"])
    assert tp8["limits"]["max_num_seqs"] == "8192 (engine default)"
