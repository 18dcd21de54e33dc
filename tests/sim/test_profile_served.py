"""`sendpath profile --url`: a live replica's own step log, fitted as it served."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sendpath.cli import main
from sendpath.engine.scheduler import RunnerOutput, SchedulerOutput
from sendpath.gateway.safety import RulesFilter
from sendpath.model.loader import LoadedModel
from sendpath.sim.cost_model import Calibrated, PointKind, ProfilePoint
from sendpath.sim.profile_served import QUICK_SERVED, profile_served
from sendpath.sim.served_loads import ServedProfileError
from tests.gateway.conftest import gateway
from tests.server.conftest import BLOCKS, serve


def test_the_replica_logs_each_step_with_its_shape(tiny: LoadedModel) -> None:
    with serve(tiny) as server:
        body = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 5,
                "ignore_eos": True}  # fmt: skip
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        found = httpx.get(f"{server.url}/v1/steps").json()
        assert found["engine"]["num_blocks"] == BLOCKS and found["engine"]["block_size"] == 16
        steps = found["steps"]
        assert [s["num_tokens"] for s in steps] == [40, 1, 1, 1, 1]  # prefill, then 4 decodes
        assert [s["busy_after"] for s in steps] == [True] * 4 + [False]
        assert steps[1]["kv_tokens"] == 41 and all(s["seconds"] > 0 for s in steps)
        later = httpx.get(f"{server.url}/v1/steps", params={"after": steps[2]["seq"]}).json()
        assert [s["seq"] for s in later["steps"]] == [s["seq"] for s in steps[3:]]


def test_a_served_profile_fits_prefill_decode_and_holds_out_mixed_steps(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    with serve(tiny) as server:
        cal = profile_served(server.url, grid=QUICK_SERVED)
        assert {p.kind for p in cal.points} == set(PointKind)
        assert all(p.seconds > 0 for p in cal.points)
        assert cal.meta["engine"]["num_blocks"] == BLOCKS and cal.device.startswith("served: cpu")
        assert all(cal.step_seconds(p.shape) > 0 for p in cal.points)
        # the late prompt's chunk shared a step with the 4 short requests' decodes
        riding = [p for p in cal.points if p.label.startswith("4 riding: mixed")]
        assert any(p.shape.prefills == 1 and p.shape.num_seqs == 5
                   and p.shape.prompt_tokens >= 8 for p in riding), riding  # fmt: skip
        assert server.idle()  # every request finished, every block back
        # 4 x 16: the answer outlasts the other 3 prompts' prefill steps
        budget = cal.meta["engine"]["max_num_batched_tokens"]
        longer = QUICK_SERVED.answer + -(-3 * 16 // budget)
        assert cal.meta["grid"]["batch_answers"] == {
            "1 x 16": QUICK_SERVED.answer,
            "4 x 16": longer,
        }
        out = tmp_path / "served.json"
        assert main(["profile", "--url", server.url, "--quick", "--out", str(out)]) == 0
        served = Calibrated.load(out)
        assert served.meta["grid"]["name"] == "served" and served.split
        # a lone request's time to first token outside the engine's steps (HTTP, tokenizer)
        assert 0 < served.meta["request_overhead_s"] < 1
        # a replica alone: no output filter, nothing to apply
        assert served.meta["first_token_hold"] is None
        assert served.meta["first_token_hold_answers"] == 0


def test_the_output_filters_hold_on_first_tokens_is_measured(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    # a rule that any text could still grow into: the filter holds every answer whole
    hold_all = RulesFilter({"never": [r".*QQZX-never-said"]})
    with serve(tiny) as replica, gateway(replica, tmp_path, safety=hold_all) as gw:
        cal = profile_served(gw.url, gw.key("profiler"), grid=QUICK_SERVED)
        hold = cal.meta["first_token_hold"]
        assert cal.meta["first_token_hold_answers"] == QUICK_SERVED.chats
        # the 32-token answers: held whole, or until the filter's 256-character cap
        assert sum(hold[QUICK_SERVED.answer // 2 :]) == pytest.approx(1)
        assert replica.idle()


def test_an_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ServedProfileError, match="cannot reach"):
        profile_served("http://127.0.0.1:9", grid=QUICK_SERVED)
    assert main(["profile", "--url", "http://127.0.0.1:9", "--quick"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_a_load_taken_while_the_machine_slowed_is_taken_again(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(tiny) as server:
        runner, slow = server.core.runner, threading.Event()
        execute = runner.execute

        def drifting(plan: SchedulerOutput) -> RunnerOutput:
            if slow.is_set():  # a neighbour on the host: every step takes longer
                time.sleep(0.05)
            return execute(plan)

        monkeypatch.setattr(runner, "execute", drifting)
        taken: list[str] = []  # each take's load, in order

        def progress(p: ProfilePoint) -> None:  # called as each take's points come in
            load = p.label.split(":")[0]
            if not taken or taken[-1] != load:
                taken.append(load)
                # slow from the end of the first "prompt 32" to the end of the next load
                first = load == "prompt 32" and taken.count(load) == 1
                slow.set() if first else slow.clear()

        # 50% drift to retake: only the slow loads, not the tiny model's timing noise
        grid = replace(QUICK_SERVED, repeats=3, drift=0.5)  # "prompt 32" twice, one label
        cal = profile_served(server.url, grid=grid, progress=progress)
        i = taken.index("prompt 32")
        assert taken[i : i + 3] == ["prompt 32", "prompt 32 after a cached prefix", "prompt 32"]
        # the load that ran slow, and the next (its reference before it was slow) again
        assert "prompt 32 after a cached prefix" in cal.meta["retaken"]
        assert "prompt 32" in cal.meta["retaken"] and cal.meta["drifted"] == []
        # the slow take is dropped (its step took the neighbour's 50 ms more); its retake
        # still finds the 32-token preamble cached; both loads of one label are kept
        kept = [p for p in cal.points if p.label.startswith("prompt 32 after a cached prefix")]
        assert kept and all(p.seconds < 0.05 and p.shape.num_tokens < 16 for p in kept), kept
        assert sum(p.label.startswith("prompt 32:") for p in cal.points) == 2
        reference = cal.meta["reference"]  # one before the first load, one after each take
        assert reference["times"] >= 1 + len(taken) and reference["median_s"] > 0
        assert server.idle()
