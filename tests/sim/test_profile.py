"""The calibrated cost model: NNLS recovers known costs, files round-trip or fail clearly,
`sendpath profile --quick` measures every kind of step, `sendpath sim --cost-model` uses it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from sendpath.cli import main
from sendpath.config import CacheConfig, EngineConfig
from sendpath.sim.calibrated import _unfitted
from sendpath.sim.cost_model import (
    TERMS,
    Calibrated,
    CostModelFileError,
    CpuStepShape,
    PointKind,
    ProfilePoint,
)
from sendpath.sim.interference import Interference
from sendpath.sim.nnls import nnls
from sendpath.sim.profile import QUICK_GRID, profile
from sendpath.sim.profile_command import print_fit

KNOWN = {"step": 0.03, "token": 0.0015, "seq": 0.0004, "context": 2e-8, "kv": 0.0}
SHAPES = [
    (PointKind.PREFILL, CpuStepShape(16, 1, 136, 16)),
    (PointKind.PREFILL, CpuStepShape(512, 1, 131_328, 512)),
    (PointKind.PREFILL, CpuStepShape(256, 1, 295_040, 1280)),
    (PointKind.DECODE, CpuStepShape(1, 1, 65, 65)),
    (PointKind.DECODE, CpuStepShape(8, 8, 8200, 8200)),
    (PointKind.DECODE, CpuStepShape(64, 64, 4160, 4160)),
    (PointKind.MIXED, CpuStepShape(20, 5, 2000, 1050)),
]
META = {
    "model": "Tiny-Test",
    "device": "cpu (x86_64, 2 cores)",
    "engine": {"num_blocks": 300, "block_size": 16, "max_num_seqs": 64},
}


def points_of(coefficients: dict[str, float]) -> list[ProfilePoint]:
    """Points whose times are exactly what ``coefficients`` predict."""
    model = Calibrated(coefficients)
    return [ProfilePoint(k, f"{k} {i}", s, model.step_seconds(s)) for i, (k, s) in
            enumerate(SHAPES)]  # fmt: skip


def test_fit_recovers_known_coefficients_exactly() -> None:
    fitted = Calibrated.fit(points_of(KNOWN), META, piecewise=False)
    for term in TERMS:
        assert fitted.coefficients[term] == pytest.approx(KNOWN[term], rel=1e-9, abs=1e-15)
    fit, held = fitted.error(), fitted.error(held_out=True)
    assert fit is not None and fit.count == 6 and fit.max < 1e-9
    assert held is not None and held.count == 1 and held.max < 1e-9


def test_coefficients_are_never_negative() -> None:
    # times that a negative per-sequence cost would explain best: the fit pins it at 0
    points = [
        ProfilePoint(p.kind, p.label, p.shape, p.seconds - 0.001 * p.shape.num_seqs)
        for p in points_of(KNOWN)
    ]
    fitted = Calibrated.fit(points, piecewise=False)
    assert fitted.coefficients["seq"] == 0.0
    assert all(v >= 0 for v in fitted.coefficients.values())
    with pytest.raises(ValueError, match="'kv' must be a number >= 0"):
        Calibrated({**KNOWN, "kv": -1.0})


def test_nnls_matches_the_best_subset() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((30, 5)), rng.standard_normal(30)
    x = nnls(a, b)
    best = np.inf
    for k in range(6):  # every set of free coefficients, solved unconstrained
        for free in itertools.combinations(range(5), k):
            sub = np.linalg.lstsq(a[:, free], b, rcond=None)[0] if free else np.zeros(0)
            if (sub >= 0).all():
                best = min(best, float(np.linalg.norm(a[:, free] @ sub - b)))
    assert (x >= 0).all() and float(np.linalg.norm(a @ x - b)) == pytest.approx(best, rel=1e-9)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    fitted = Calibrated.fit(points_of(KNOWN), META)
    path = tmp_path / "profile.json"
    fitted.save(path)
    loaded = Calibrated.load(path)
    assert loaded.coefficients == fitted.coefficients
    assert loaded.points == fitted.points
    assert loaded.meta == META and loaded.model_name == "Tiny-Test"
    assert loaded.engine == {"num_blocks": 300, "block_size": 16, "max_num_seqs": 64}
    data = json.loads(path.read_text())
    assert data["fit"]["fit_points"]["count"] == 6 and data["fit"]["held_out"]["count"] == 1
    assert [p["kind"] for p in data["points"]].count("mixed") == 1


def test_a_split_profile_from_before_versions_4_and_5_loads_with_its_old_prices(
    tmp_path: Path,
) -> None:
    split = {"step": 0.04, "prompt": 0.0015, "prefill": 0.03, "resume": 0.02, "context": 1e-9,
             "kv": 1e-5, "ride": 0.002, "seq": 0.01}  # fmt: skip
    v5 = Calibrated(split, split=True)
    assert v5.coefficients["prefilling"] == v5.coefficients["riding"] == 0  # none given
    data = {**v5.to_json(), "version": 3, "coefficients_s": split}  # neither key
    (tmp_path / "v3.json").write_text(json.dumps(data))
    old = Calibrated.load(tmp_path / "v3.json")
    shape = CpuStepShape(70, 3, 2000, 300, 64, 1, 0, 300)
    assert old.step_seconds(shape) == pytest.approx(0.04 + 64 * 0.0015 + 0.03 + 2e-6 + 3e-3
                                                    + 2 * 0.002)  # fmt: skip
    v4 = {**data, "version": 4, "coefficients_s": {**split, "prefilling": 0.01}}
    (tmp_path / "v4.json").write_text(json.dumps(v4))
    assert Calibrated.load(tmp_path / "v4.json").step_seconds(shape) == pytest.approx(
        old.step_seconds(shape) + 0.01
    )  # no ``riding`` before version 5
    for version, lacking in ((4, "prefilling"), (5, "riding")):
        coefficients = {**split, "prefilling": 0.01, "riding": 0.02}
        del coefficients[lacking]
        (tmp_path / "new.json").write_text(
            json.dumps({**data, "version": version, "coefficients_s": coefficients})
        )
        with pytest.raises(CostModelFileError, match=lacking):
            Calibrated.load(tmp_path / "new.json")  # a file of that version has it


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        ('{"coefficients_s": {}}', "not a sendpath-profile file"),
        ('{"format": "sendpath-profile", "version": 9}', "version 9, expected 1 to 5"),
        ('{"format": "sendpath-profile", "version": 1}', "malformed"),
        ('{"format": "sendpath-profile", "version": 1, "coefficients_s": {"step": -1}}',
         "malformed"),
    ],
)  # fmt: skip
def test_a_bad_file_says_which_and_what_to_do(
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


def test_quick_profile_measures_every_kind_of_step(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=128)
    )
    cal = profile(config, QUICK_GRID, guard=False)  # every step counts: exact shapes
    assert [(p.label, p.shape) for p in cal.points] == [
        ("prefill 8 @ 0", CpuStepShape(8, 1, 36, 8, 8, 1, kv_gathered=8)),
        ("prefill 32 @ 0", CpuStepShape(32, 1, 528, 32, 32, 1, kv_gathered=32)),
        ("prefill 16 @ 32", CpuStepShape(16, 1, 16 * 32 + 136, 48, 16, 1, 1, 48)),
        # each batch is timed after the larger one, one token further on per step; the
        # decodes' KV gathered in whole blocks of 16
        ("decode 4 x 16", CpuStepShape(4, 4, 4 * 19, 4 * 19, kv_gathered=4 * 32)),
        ("decode 1 x 16", CpuStepShape(1, 1, 22, 22, kv_gathered=32)),
        ("decode 4 x 64", CpuStepShape(4, 4, 4 * 67, 4 * 67, kv_gathered=4 * 80)),
        ("decode 1 x 64", CpuStepShape(1, 1, 70, 70, kv_gathered=80)),
        (
            "mixed 2 x 32 + 16 @ 0",
            CpuStepShape(18, 3, 2 * 35 + 136, 2 * 35 + 16, 16, 1, kv_gathered=2 * 48 + 16),
        ),
    ]
    assert {p.kind for p in cal.points} == set(PointKind)
    assert all(p.seconds > 0 and cal.step_seconds(p.shape) > 0 for p in cal.points)
    assert all(v >= 0 for v in cal.coefficients.values())
    assert cal.meta["engine"]["num_blocks"] == 128 and cal.meta["dtype"] == "float32"
    assert cal.meta["device"].startswith("cpu") and cal.meta["skipped"] == []
    assert cal.meta["retaken_steps"] == 0 and cal.meta["noisy"] == []


def test_a_step_is_clean_while_the_others_stay_under_a_tenth_of_it() -> None:
    watch = Interference()
    tick = watch.tick_s
    assert watch.clean(0.1, 0.01 + 2 * tick) and not watch.clean(0.1, 0.011 + 2 * tick)
    assert watch.clean(2.0, 0.2) and not watch.clean(2.0, 0.5)


def test_profile_command_writes_a_file_sim_can_load(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--quick", "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--kv-cache-memory-gib",
            "0.001", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured vs fitted" in printed and f"wrote {out}" in printed
    assert Calibrated.load(out).engine["num_blocks"] == 131  # 1.07 MB / (512 B x 16 tokens)


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


def test_the_per_sequence_cost_may_bend_at_each_batch_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a CPU where 4 sequences cost nearly what 8 do: a line through batch sizes misses it
    knots = (1, 2, 4, 8)
    costs = {"step": 0.04, "token": 0.0015, "context": 1e-8, "kv": 1e-6,
             "seqs@2": 0.02, "seqs@4": 0.055, "seqs@8": 0.06}  # fmt: skip
    truth = Calibrated(costs, seq_knots=knots)
    shapes = [CpuStepShape(n, 1, n * (n + 1) // 2, n) for n in (16, 64, 256)]
    shapes += [CpuStepShape(b, b, b * c, b * c) for b in (1, 2, 3, 4, 6, 8) for c in (64, 512)]
    points = [ProfilePoint(PointKind.DECODE if s.num_seqs > 1 or s.num_tokens == 1
                           else PointKind.PREFILL, str(s), s, truth.step_seconds(s))
              for s in shapes]  # fmt: skip
    fitted = Calibrated.fit(points)
    assert fitted.seq_knots == knots
    for term, value in truth.coefficients.items():
        assert fitted.coefficients[term] == pytest.approx(value, rel=1e-6, abs=1e-12)
    # 3 sequences: halfway between the knots at 2 and 4; 12: the last slope carried on
    three = CpuStepShape(3, 3, 3, 3)
    assert truth.step_seconds(three) == pytest.approx(
        0.04 + 3 * 0.0015 + 3e-8 + 3e-6 + (0.02 + 0.055) / 2
    )
    twelve = CpuStepShape(12, 12, 12, 12)
    assert truth.step_seconds(twelve) == pytest.approx(
        0.04 + 12 * 0.0015 + 12e-8 + 12e-6 + 0.06 + (0.06 - 0.055)
    )
    print_fit(fitted)  # the table and the bends, as `sendpath profile` prints them
    printed = capsys.readouterr().out
    assert "per-sequence ms by batch size (1: 0, 2: 20.0, 4: 55.0, 8: 60.0)" in printed
    linear = Calibrated.fit(points, piecewise=False)
    assert linear.error() is not None and fitted.error() is not None
    assert fitted.error().max < 1e-6 < linear.error().max  # type: ignore[union-attr]


def test_a_split_fit_prices_prompt_chunks_resumed_chunks_and_riding_decodes_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # what the CPU runner does: a step with prompt chunks takes their path once, then a
    # little per chunk; a chunk resuming past 0 takes the masked path; decodes beside a
    # prefill ride in its matmuls, after one attention call for all of them; decode-only
    # steps bend by batch size
    truth = Calibrated(
        {"step": 0.045, "prompt": 0.0014, "prefill": 0.005, "prefilling": 0.03, "resume": 0.02,
         "context": 6e-7, "kv": 9e-6, "ride": 0.004, "riding": 0.025, "seqs@2": 0.022,
         "seqs@4": 0.06, "seqs@8": 0.068},
        seq_knots=(1, 2, 4, 8), split=True,
    )  # fmt: skip

    def prefill(n: int, start: int) -> CpuStepShape:
        return CpuStepShape(n, 1, n * start + n * (n + 1) // 2, start + n, n, 1, int(start > 0),
                         start + n)  # fmt: skip

    def decode(b: int, ctx: int) -> CpuStepShape:
        return CpuStepShape(b, b, b * ctx, b * ctx, kv_gathered=b * -(-ctx // 16) * 16)

    def mixed(b: int, ctx: int, n: int, start: int) -> CpuStepShape:
        p, d = prefill(n, start), decode(b, ctx)
        return CpuStepShape(n + b, b + 1, p.context_tokens + d.context_tokens,
                         p.kv_tokens + d.kv_tokens, n, 1, p.resumed,
                         p.kv_gathered + d.kv_gathered)  # fmt: skip

    shapes = [(PointKind.PREFILL, prefill(n, s)) for n in (16, 64, 256, 512) for s in (0, 32, 512)]
    shapes += [(PointKind.DECODE, decode(b, c)) for b in (1, 2, 3, 4, 6, 8) for c in (64, 512)]
    shapes += [(PointKind.MIXED, mixed(b, 300, n, s)) for b in (2, 8) for n in (64, 256)
               for s in (0, 32)]  # fmt: skip
    for chunks in (2, 4):  # several prompts' chunks in one step, 3 decodes riding (fitted)
        one = mixed(3, 100, 48, 0)
        shapes.append((PointKind.PREFILL, CpuStepShape(
            48 * chunks + 3, 3 + chunks, one.context_tokens + (chunks - 1) * 48 * 49 // 2,
            one.kv_tokens + (chunks - 1) * 48, 48 * chunks, chunks, 0,
            one.kv_gathered + (chunks - 1) * 48)))  # fmt: skip
    points = [ProfilePoint(k, f"p{i}", s, truth.step_seconds(s)) for i, (k, s) in
              enumerate(shapes)]  # fmt: skip
    fitted = Calibrated.fit(points)
    assert fitted.split and fitted.seq_knots == (1, 2, 4, 8)
    for term, value in truth.coefficients.items():
        assert fitted.coefficients[term] == pytest.approx(value, rel=1e-6, abs=1e-12)
    assert fitted.held_out.count(True) == 4  # every second mixed step checks the fit
    # with a single chunk in every step, a step's prefill cost is a chunk's: one term
    singles = Calibrated.fit([p for p in points if p.shape.prefills < 2])
    assert singles.coefficients["prefilling"] == 0
    assert singles.coefficients["prefill"] == pytest.approx(0.035, rel=1e-6)
    assert singles.unfitted == {"prefilling"} and fitted.unfitted == set()
    print_fit(singles)  # says so, where it would print "0.00 ms a step with prefill chunks"
    shown = capsys.readouterr().out
    assert "not fitted (the grid cannot tell them apart from other terms): prefilling" in shown
    assert "n/a ms a step with prefill chunks + 35.00 ms a chunk" in shown
    # ``riding`` is told apart only by prompt steps with no decodes and with two numbers
    # of them; else it is ``prefilling``'s column (or ``ride``'s), and left at 0
    assert _unfitted([p for p in points if not p.shape.prefills or p.shape.prefills > 1]) == {
        "riding"}  # fmt: skip
    for keep in (lambda d: d > 0, lambda d: d == 0, lambda d: d in (0, 3)):
        some = [p for p in points if keep(p.shape.num_seqs - p.shape.prefills) or
                not p.shape.prefills]  # fmt: skip
        assert "riding" in _unfitted(some)
        assert Calibrated.fit(some).coefficients["riding"] == 0
    assert _unfitted(points) == set()
    held = fitted.error(held_out=True)
    assert held is not None and held.max < 1e-9
    # a resumed 100-token chunk costs ``resume`` more than one from position 0
    later, first = prefill(100, 16), prefill(100, 0)
    extra = fitted.step_seconds(later) - fitted.step_seconds(first)
    assert extra == pytest.approx(0.02 + 6e-7 * 100 * 16 + 9e-6 * 16)
