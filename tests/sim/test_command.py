"""`sendpath sim` and `sim plan` on the command line: a GPU answer prints the calibration
it rests on; a run far outside it is refused unless --allow-extrapolation, which warns;
the cpu entry is not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sendpath.cli import main
from sendpath.sim.coverage import coverage

PLAN = ["sim", "plan", "--rate", "4", "--requests", "40", "--input-len", "128",
        "--output-len", "32", "--slo-ttft-p99-ms", "2000", "--slo-tpot-p99-ms", "200"]  # fmt: skip
WARNING = "warning: extrapolated, checked against no published measurement: "


def test_a_plan_prints_the_calibration_it_rests_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--json", str(out)]) == 0
    answer, *rest = capsys.readouterr().out.splitlines()
    assert answer.startswith("1 replica(s) of 1 x H100-SXM serving Llama-3.1-8B meet")
    assert rest == coverage().lines("bf16")
    cal = json.loads(out.read_text())["simulated"]["calibration"]
    assert cal["summary"] == rest and cal["extrapolated"] == [] and cal["precision"] == "bf16"
    assert cal["fitted_on"] == list(coverage().fitted_on)
    assert cal["held_out_error"]["throughput"]["mean_error"] == 0.0942  # gpu_calibration.json


def test_an_fp8_plan_shows_fp8s_own_held_out_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--precision", "fp8"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == coverage().lines("fp8")
    assert main([*PLAN, "--precision", "fp8", "--hardware", "A100"]) == 2
    assert "A100-80GB-SXM has no fp8 tensor cores" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named", "covered"),
    [
        (
            ["--hardware", "L4"],
            "GPU L4 was measured by no source",
            "(calibrated: A100, H100, H200)",
        ),
        (
            ["--model", "smollm2-135m"],
            "model SmolLM2-135M has 0.134B parameters",
            "outside 3.37B-106B",
        ),
        (["--tp", "16"], "tensor parallelism 16 is above", "the largest calibrated, 8"),
    ],
    ids=["gpu", "model", "tp"],
)
def test_a_plan_outside_the_calibration_is_refused_and_the_flag_goes_on_with_a_warning(
    flags: list[str], named: str, covered: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, *flags]) == 2
    seen = capsys.readouterr()
    assert seen.out == "" and named in seen.err and covered in seen.err
    assert "pass --allow-extrapolation to price it anyway" in seen.err
    assert main([*PLAN, *flags, "--allow-extrapolation"]) == 0
    answer, warning, *rest = capsys.readouterr().out.splitlines()
    assert answer.startswith("1 replica(s)")
    assert warning.startswith(WARNING + named) and covered in warning
    assert rest == coverage().lines("bf16")


def test_sim_runs_are_checked_and_print_the_calibration_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sim", "--requests", "5", "--hardware", "l4"]) == 2
    assert "GPU L4 was measured by no source" in capsys.readouterr().err
    assert main(["sim", "--requests", "5"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as one line, however rich wrapped it
    assert " ".join(coverage().lines("bf16")) in out


def test_the_cpu_entry_is_not_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.json"
    cpu = [*PLAN[:4], "--requests", "10", *PLAN[6:], "--hardware", "cpu", "--json", str(out)]
    assert main([*cpu, "--model", "smollm2-135m"]) == 0  # a 135M model: fine on the cpu
    (answer,) = capsys.readouterr().out.splitlines()
    assert "cpu-2core serving SmolLM2-135M" in answer
    assert json.loads(out.read_text())["simulated"]["calibration"] is None
    assert main([*cpu, "--precision", "fp8"]) == 2  # precision is a GPU's, not the roofline's
    assert "--precision sets a GPU's weights" in capsys.readouterr().err
