"""`serve --ray` / `gateway --ray` flags: a bad scaling or placement is refused with one
line before anything starts (no Ray is started by these)."""

from __future__ import annotations

import pytest

from sendpath.cli import main

pytest.importorskip("ray.serve")  # the messages below come from Serve's own config checks


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--max-replicas", "2"],
         "error: --max-replicas needs --ray (Ray Serve scales the replicas)"),
        (["serve", "--ray", "auto", "--min-replicas", "3", "--max-replicas", "2"],
         "error: need 1 <= --min-replicas <= --max-replicas, got 3 and 2"),
        (["serve", "--ray", "auto", "--min-replicas", "1"],
         "error: --min-replicas needs --max-replicas (autoscaling)"),
        (["serve", "--ray", "auto", "--ray-autoscaling-config", '{"downscale_delay_s": 5}'],
         "error: --ray-autoscaling-config needs --max-replicas (autoscaling)"),
        (["serve", "--ray", "auto", "--max-replicas", "2",
          "--ray-autoscaling-config", '{"policy": "x", "nope": 1}'],
         "error: --ray-autoscaling-config: nope, policy cannot be set there (unknown, or a "
         "flag of its own: --min-replicas, --max-replicas, --target-ongoing-requests)"),
        (["serve", "--ray", "auto", "--max-replicas", "2",
          "--ray-autoscaling-config", '{"upscale_delay_s": -1}'],
         "error: --ray-autoscaling-config: upscale_delay_s: Input should be greater than or "
         "equal to 0"),
        (["serve", "--ray", "auto", "--replica-num-gpus", "-1"],
         "error: --replica-num-cpus and --replica-num-gpus must be >= 0"),
        (["serve", "--ray", "auto", "--target-ongoing-requests", "0", "--max-replicas", "2"],
         "error: --target-ongoing-requests must be > 0"),
        (["gateway"], "error: give the replicas: --replica URL (repeatable) or --ray ADDRESS"),
    ],
)  # fmt: skip
def test_bad_ray_flags_are_refused_before_starting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message and "Traceback" not in err


def test_a_bad_autoscaling_json_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ray", "auto", "--max-replicas", "2", "--ray-autoscaling-config", "[1]"])
    assert exit_.value.code == 2
    assert "give a JSON object of Serve AutoscalingConfig keys" in capsys.readouterr().err
