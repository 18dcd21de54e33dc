"""The calibrated cost model: the fit recovers known costs, files round-trip or fail clearly,
`sendpath profile --quick` fits the real engine's step log, `sendpath sim --cost-model` uses it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sendpath.cli import main
from sendpath.config import CacheConfig, EngineConfig
from sendpath.engine.steps import StepShape
from sendpath.sim.calibrated import Calibrated, CostModelFileError, PointKind, ProfilePoint
from sendpath.sim.config import SimConfig
from sendpath.sim.profile import QUICK_GRID, profile
from sendpath.sim.profile_command import print_fit

# what the CPU runner does: a step, then per prompt token, per position attended, per KV
# position read and per decode row
KNOWN = {"step": 0.045, "prompt": 0.0014, "context": 6e-7, "kv": 9e-6, "decode": 0.004}
META = {
    "model": "Tiny-Test",
    "device": "cpu (x86_64, 2 cores)",
    "engine": {"num_blocks": 300, "block_size": 16, "max_num_seqs": 64},
}


def prefill(n: int, start: int) -> StepShape:
    return StepShape(n, 1, n * start + n * (n + 1) // 2, start + n, n, 1)


def decode(b: int, ctx: int) -> StepShape:
    return StepShape(b, b, b * ctx, b * ctx)


def mixed(b: int, ctx: int, n: int, start: int, chunks: int = 1) -> StepShape:
    """``b`` decodes at ``ctx`` beside ``chunks`` chunks of ``n`` tokens from ``start``."""
    p, d = prefill(n, start), decode(b, ctx)
    return StepShape(
        n * chunks + b,
        b + chunks,
        p.context_tokens * chunks + d.context_tokens,
        p.kv_tokens * chunks + d.kv_tokens,
        n * chunks,
        chunks,
    )


def points_of(coefficients: dict[str, float]) -> list[ProfilePoint]:
    """Points of every kind whose times are exactly what ``coefficients`` predict."""
    shapes = [(PointKind.PREFILL, prefill(n, s)) for n in (16, 64, 256, 512) for s in (0, 32, 512)]
    shapes += [(PointKind.DECODE, decode(b, c)) for b in (1, 2, 3, 4, 6, 8) for c in (64, 512)]
    shapes += [
        (PointKind.MIXED, mixed(b, 300, n, s)) for b in (2, 8) for n in (64, 256) for s in (0, 32)
    ]
    # several prompts' chunks in one step, 3 decodes riding (a served profile's steps)
    shapes += [(PointKind.MIXED, mixed(3, 100, 48, 0, chunks)) for chunks in (2, 4)]
    truth = Calibrated(coefficients)
    return [ProfilePoint(k, f"p{i}", s, truth.step_seconds(s)) for i, (k, s) in enumerate(shapes)]


def test_the_fit_prices_prompt_chunks_their_context_and_decodes_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    points = points_of(KNOWN)
    fitted = Calibrated.fit(points, META)
    for term, value in KNOWN.items():
        assert fitted.coefficients[term] == pytest.approx(value, rel=1e-6, abs=1e-12)
    fit = fitted.error()
    assert fit is not None and fit.count == len(points) and fit.max < 1e-9
    mixed = fitted.error(PointKind.MIXED)
    assert mixed is not None and mixed.count == 10
    # a 100-token chunk resumed at 16 costs its extra context and the KV it reads
    extra = fitted.step_seconds(prefill(100, 16)) - fitted.step_seconds(prefill(100, 0))
    assert extra == pytest.approx(6e-7 * 100 * 16 + 9e-6 * 16)
    # 8 decodes cost 7 more decodes' rows than 1 (and the KV they read)
    more = fitted.step_seconds(decode(8, 64)) - fitted.step_seconds(decode(1, 64))
    assert more == pytest.approx(7 * (0.004 + 6e-7 * 64 + 9e-6 * 64))
    print_fit(fitted)
    shown = capsys.readouterr().out
    assert "fitted, in ms (the terms: sendpath/sim/calibrated.py): step 45, prompt 1.4," in shown
    assert "decode 4" in shown and "relative error on 10 mixed points: max 0.0%" in shown


def test_coefficients_are_never_negative() -> None:
    # times that a negative per-decode cost would explain best: the fit pins it at 0
    points = [ProfilePoint(p.kind, p.label, p.shape,
                           p.seconds - 0.002 * (p.shape.num_seqs - p.shape.prefills))
              for p in points_of({**KNOWN, "decode": 0.0})]  # fmt: skip
    fitted = Calibrated.fit(points)
    assert fitted.coefficients["decode"] == 0.0
    assert all(v >= 0 for v in fitted.coefficients.values())
    with pytest.raises(ValueError, match="'kv' must be a number >= 0"):
        Calibrated({**KNOWN, "kv": -1.0})


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    fitted = Calibrated.fit(points_of(KNOWN), META)
    path = tmp_path / "profile.json"
    fitted.save(path)
    loaded = Calibrated.load(path)
    assert loaded.coefficients == fitted.coefficients
    assert loaded.points == fitted.points
    assert loaded.meta == META and loaded.model_name == "Tiny-Test"
    # the simulator takes the profiled engine's KV cache and batch limits
    config = loaded.sim_config(SimConfig())
    assert (config.num_blocks, config.block_size, config.scheduler.max_num_seqs) == (300, 16, 64)
    data = json.loads(path.read_text())
    assert data["version"] == 8 and data["fit"]["count"] == 34


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        ('{"coefficients_s": {}}', "not a sendpath-profile file"),
        # an older form of the file: re-profile
        ('{"format": "sendpath-profile", "version": 7, "seq_knots": [1]}',
         "version 7, and this sendpath reads only 8"),
        ('{"format": "sendpath-profile", "version": 8}', "malformed"),
        ('{"format": "sendpath-profile", "version": 8, "meta": {}, "points": [], '
         '"coefficients_s": {"step": -1}}', "malformed"),
    ],
)  # fmt: skip
def test_a_bad_or_old_file_says_which_and_what_to_do(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CostModelFileError) as caught:
        Calibrated.load(path)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert str(path) in message and problem in message
    assert f"run `sendpath profile --out {path}`" in message


def test_quick_profile_serves_the_engine_in_process_and_fits_its_step_log(
    tiny_llama_dir: Path,
) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=128)
    )
    cal = profile(config, QUICK_GRID)
    # one point per load, kind and step size, each the median of the steps the engine
    # logged for it; the sizes are the engine's own scheduling of each load
    loads = {p.label.split(":")[0] for p in cal.points}
    assert loads == {"prompt 8", "prompt 8 after a cached prefix", "prompt 48",
                     "prompt 48 after a cached prefix", "1 x 16", "4 x 16", "4 riding"}  # fmt: skip
    assert {p.kind for p in cal.points} == set(PointKind)
    # a prompt after the cached preamble resumes past it: its N tokens' chunk reads the
    # cached KV (a prompt shorter than the preamble too: not a one-token step)
    for n in (8, 48):
        resumed = [p for p in cal.points if p.label.startswith(f"prompt {n} after")]
        assert resumed and all(p.kind == PointKind.PREFILL for p in resumed), resumed
        assert all(p.shape.kv_tokens >= p.shape.prompt_tokens + 32 for p in resumed), resumed
        assert sum(p.shape.prompt_tokens for p in resumed) >= n - 1, resumed
    # the late prompt's chunk shared a step with the 4 riders' decodes
    riding = [p.shape for p in cal.points if p.label.startswith("4 riding: mixed")]
    assert any(s.prefills == 1 and s.num_seqs == 5 for s in riding), riding
    assert all(p.seconds > 0 and cal.step_seconds(p.shape) > 0 for p in cal.points)
    assert all(v >= 0 for v in cal.coefficients.values())
    assert cal.meta["engine"]["num_blocks"] == 128 and cal.meta["dtype"] == "float32"
    assert cal.meta["device"].startswith("cpu") and cal.meta["skipped"] == []
    # the replica served in process: its HTTP time, no gateway (no output filter), no URL
    assert 0 < cal.meta["request_overhead_s"] < 1 and cal.meta["first_token_hold"] is None
    assert "served_at" not in cal.meta


def test_profile_command_writes_a_file_sim_can_load(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--quick", "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--kv-cache-memory-gib", "0.001", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured vs fitted" in printed and f"wrote {out}" in printed
    assert Calibrated.load(out).meta["engine"]["num_blocks"] == 131  # 1.07 MB / (512 B x 16 tokens)


def test_ctrl_c_stops_the_profile_and_its_server_and_writes_nothing(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "p.json"
    argv = [sys.executable, "-m", "sendpath.cli", "profile", "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--kv-cache-memory-gib", "0.01", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(  # Ctrl-C's default, also where the tests run in the background
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the first point: the loads run (the full grid: minutes)
            if line.startswith("  prompt 16"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted; nothing written" in err
    assert "Traceback" not in err and not out.exists()


def test_sim_with_a_cost_model(tmp_path: Path) -> None:
    path, report = tmp_path / "cpu.json", tmp_path / "report.json"
    Calibrated.fit(points_of(KNOWN), META).save(path)
    argv = ["sim", "--cost-model", str(path), "--rate", "1", "--requests", "20",
            "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(report.read_text())["simulated"]
    assert s["hardware"] == "calibrated: cpu.json (cpu (x86_64, 2 cores))"
    assert s["model"] == "Tiny-Test" and s["kv_blocks_per_replica"] == 300
    # a served profile's time outside the steps goes on every request's way in and out
    ttft = json.loads(report.read_text())["median_ttft_ms"]
    Calibrated.fit(points_of(KNOWN), {**META, "request_overhead_s": 0.25}).save(path)
    assert main(argv) == 0
    later = json.loads(report.read_text())
    assert later["median_ttft_ms"] == pytest.approx(ttft + 250 - 20, rel=1e-6)  # not 20 ms
    # and its output filter's hold: every first token reaches the client with the next one
    meta = {**META, "request_overhead_s": 0.25, "first_token_hold": [0.0, 1.0]}
    Calibrated.fit(points_of(KNOWN), meta).save(path)
    assert main(argv) == 0
    held = json.loads(report.read_text())
    assert held["median_ttft_ms"] > later["median_ttft_ms"]
    assert held["median_e2el_ms"] == pytest.approx(later["median_e2el_ms"])
    Calibrated.fit(points_of(KNOWN), {**meta, "first_token_hold": [None, 1.0]}).save(path)
    assert main(argv) == 2  # not shares: a clear error, no traceback


def test_sim_with_a_bad_cost_model_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["sim", "--cost-model", str(missing), "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cost model '{missing}': no such file")
    assert "run `sendpath profile" in err


def test_the_help_says_to_profile_on_an_idle_machine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert "Profile on an idle machine" in " ".join(capsys.readouterr().out.split())
