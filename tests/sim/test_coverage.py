"""What the fitted GPU terms cover: read from the calibration and its sources' setups, and
a run outside it named value by value, with the covered range."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sendpath.bench.workload import LengthSpec
from sendpath.sim.coverage import Coverage, OutsideCalibration, coverage
from sendpath.sim.gpu_model import calibration
from sendpath.sim.gpu_sources import load_sources
from sendpath.sim.hardware import ModelSpec, model_spec
from sendpath.sim.traffic import Traffic

LLAMA_8B = model_spec("llama-3.1-8b")
# Llama 3.2 3B and Llama 3.1 405B (their config.json files): just below and far above
LLAMA_3B = ModelSpec("Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, tied=True)
LLAMA_405B = ModelSpec("Llama-3.1-405B", 126, 16384, 128, 8, 53248, 128256)


def test_the_shipped_calibration_covers_what_its_replayed_sources_ran() -> None:
    cover = coverage()
    # the SGLang-repository sources publish ShareGPT runs without lengths: nothing replayed
    assert cover.published == 24 and len(cover.fitted_on) == 11 and len(cover.held_out) == 7
    assert not any(name.startswith("sglang-repo") for name in cover.fitted_on + cover.held_out)
    assert cover.engines == (
        "LMDeploy 0.1.0a1",
        "TensorRT-LLM 0.5/0.6.1/0.13.0/0.14.0",
        "vLLM 0.8.2",
    )
    assert cover.gpus == ("A100", "H100", "H200")
    assert cover.params == (model_spec("llama-2-7b").params, model_spec("llama-3.1-70b").params)
    assert cover.tps == (1, 4, 8)
    assert cover.fitted_precisions == ("bf16", "fp16")
    assert cover.precisions == ("bf16", "fp16", "fp8")
    assert cover.error_sources == {"bf16": 4, "fp16": 4, "fp8": 3}
    assert cover.errors["fp8"] == calibration().held_out_error_fp8


def test_a_run_inside_is_not_refused() -> None:
    cover = coverage()
    assert cover.outside("H100", LLAMA_8B, 1, "bf16") == []
    assert cover.outside("H200", model_spec("llama-3.1-70b"), 4, "fp8") == []
    assert cover.outside("A100", model_spec("llama-2-13b"), 2, "fp16") == []  # tp between


def test_each_thing_outside_is_named_with_the_covered_range() -> None:
    cover = coverage()
    assert cover.outside("L4", LLAMA_8B, 1, "bf16") == [
        "GPU L4 was measured by no source (calibrated: A100, H100, H200)"
    ]
    assert cover.outside("H100", LLAMA_8B, 16, "bf16") == [
        "tensor parallelism 16 is above the largest calibrated, 8 (calibrated: tp 1, 4, 8)"
    ]
    range_ = "outside 3.37B-106B (0.5x the smallest to 1.5x the largest calibrated model: "
    for model, params in ((LLAMA_3B, "3.21B"), (model_spec("smollm2-135m"), "0.134B"),
                          (LLAMA_405B, "406B")):  # fmt: skip
        assert cover.outside("H100", model, 1, "bf16") == [
            f"model {model.name} has {params} parameters, {range_}6.74B-70.6B)"
        ]
    assert len(cover.outside("L4", LLAMA_405B, 16, "bf16")) == 3  # all of them, one each


def test_a_request_far_longer_than_any_source_ran_is_refused() -> None:
    cover = coverage()
    # the longest replayed measurement: a 32,000-token prompt with a 100-token answer
    assert cover.context == 32_100
    inside = Traffic(1.0, 10, LengthSpec(1_000, 40_050), LengthSpec(100, 8_100))
    assert inside.longest_request == 48_150 == cover.priced_context  # at the limit: priced
    assert cover.outside("H100", LLAMA_8B, 1, "bf16", inside) == []
    # four turns, each resending the history under a 2,000-token system prompt
    chat = Traffic(1.0, 10, LengthSpec(2_000, 4_000), LengthSpec(500, 8_000), shared_prefix=2_000,
                   turns=4)  # fmt: skip
    assert chat.longest_request == 2_000 + 4 * 12_000
    assert cover.outside("H100", LLAMA_8B, 1, "bf16", chat) == [
        "its longest request holds 50,000 tokens (shared prefix, then every turn's question "
        "and answer), above 48,150 (1.5x the longest calibrated request: 32,100 tokens)"
    ]


def test_a_precision_no_source_ran_is_refused_and_the_ranges_follow_the_sources() -> None:
    shipped, sources = calibration(), load_sources()
    # the calibration without the sources that ran fp8 weights or an H200, read from setups
    kept = {s.name for s in sources if s.setup.precision != "fp8" and "H200" not in s.setup.gpu}
    assert 0 < len(kept) < len(sources)
    no_fp8_no_h200 = replace(
        shipped,
        fitted_on=tuple(name for name in shipped.fitted_on if name in kept),
        held_out=tuple(name for name in shipped.held_out if name in kept),
        held_out_error_fp8={},
    )
    cover = Coverage.of(no_fp8_no_h200, sources)
    assert cover.precisions == ("bf16", "fp16")
    assert cover.gpus == ("A100", "H100")
    assert cover.outside("H100", LLAMA_8B, 1, "fp8") == [
        "precision fp8 was run by no source (calibrated: bf16, fp16)"
    ]
    assert cover.outside("H200", LLAMA_8B, 1, "bf16") == [
        "GPU H200 was measured by no source (calibrated: A100, H100)"
    ]


def test_the_answer_says_what_it_rests_on_and_the_refusal_how_to_go_on() -> None:
    """The lines as printed; their error figures are gpu_calibration.json's, rounded."""
    cover = coverage()
    assert cover.lines("bf16") == [
        "rests on: 18 of 24 published engine benchmarks (11 fitted, 7 held out: LMDeploy "
        "0.1.0a1, TensorRT-LLM 0.5/0.6.1/0.13.0/0.14.0, vLLM 0.8.2) on A100/H100/H200; Llama-2 "
        "7B/13B/70B, Llama-3.1 8B/70B (6.74B-70.6B parameters); tp 1-8; requests up to 32,100 "
        "tokens; bf16/fp16, fp8 held out only",
        "held-out error (bf16/fp16; 4 sources): throughput 9% mean, TPOT 8%, TTFT 26%",
    ]
    assert cover.lines("fp8")[1] == (
        "held-out error (fp8, not fitted; 3 sources): throughput 22% mean, TPOT 15%, TTFT 30%"
    )
    report = cover.report("fp8", [])
    assert report["summary"] == cover.lines("fp8") and report["held_out_error_sources"] == 3
    assert report["covers"]["priced_params_b"] == [3.369, 105.829]
    assert report["covers"]["priced_request_tokens"] == 48_150
    problems = cover.outside("L4", LLAMA_8B, 1, "bf16")
    with pytest.raises(OutsideCalibration) as refused:
        raise OutsideCalibration(problems, cover)
    message = str(refused.value)
    assert message.startswith(f"this run lies outside the GPU calibration:\n  - {problems[0]}\n")
    assert "prices models of 3.37B-106B parameters" in message
    assert message.endswith(
        "pass --allow-extrapolation to price it anyway (the answer then warns)."
    )
