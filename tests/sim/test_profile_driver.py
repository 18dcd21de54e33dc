"""`sendpath profile --url`: a live replica's own step log, fitted as it served; the loads
it sends, and how a refusal ends them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from sendpath.cli import main
from sendpath.gateway.safety import RulesFilter
from sendpath.model.loader import LoadedModel
from sendpath.sim.calibrated import Calibrated, PointKind
from sendpath.sim.profile import QUICK_GRID, profile_served
from sendpath.sim.profile_driver import Load, LoadDriver, ServedProfileError
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


def test_a_served_profile_fits_prefill_decode_and_mixed_steps(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    with serve(tiny) as server:
        cal = profile_served(server.url, grid=QUICK_GRID)
        assert {p.kind for p in cal.points} == set(PointKind)
        assert all(p.seconds > 0 for p in cal.points)
        assert cal.meta["engine"]["num_blocks"] == BLOCKS and cal.device.startswith("cpu")
        assert all(cal.step_seconds(p.shape) > 0 for p in cal.points)
        # the late prompt's chunk shared a step with the 4 short requests' decodes
        riding = [p for p in cal.points if p.label.startswith("4 riding: mixed")]
        assert any(p.shape.prefills == 1 and p.shape.num_seqs == 5
                   and p.shape.prompt_tokens >= 8 for p in riding), riding  # fmt: skip
        assert server.idle()  # every request finished, every block back
        out = tmp_path / "served.json"
        assert main(["profile", "--url", server.url, "--quick", "--out", str(out)]) == 0
        served = Calibrated.load(out)
        assert served.meta["served_at"] == server.url and served.points
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
        cal = profile_served(gw.url, gw.key("profiler"), grid=QUICK_GRID)
        hold = cal.meta["first_token_hold"]
        assert cal.meta["first_token_hold_answers"] == QUICK_GRID.chats
        # the 32-token answers: held whole, or until the filter's 256-character cap
        assert sum(hold[QUICK_GRID.answer // 2 :]) == pytest.approx(1)
        assert replica.idle()


def test_an_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ServedProfileError, match="cannot reach"):
        profile_served("http://127.0.0.1:9", grid=QUICK_GRID)
    assert main(["profile", "--url", "http://127.0.0.1:9", "--quick"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_a_refused_request_ends_the_profile_with_its_error_not_a_hang() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "queue full"}})

    async def ride() -> None:
        driver = LoadDriver("http://server.test", None)
        driver.client = httpx.AsyncClient(transport=httpx.MockTransport(refuse),
                                          base_url="http://server.test")  # fmt: skip
        async with driver.client:
            # the riders wait for each other's first token: a refusal must not leave them
            riders = Load("4 riding", 4, 16, 8, late=(16,))
            await asyncio.wait_for(driver.run("m", riders), timeout=10)

    with pytest.raises(ServedProfileError, match="failed: HTTP 503: queue full"):
        asyncio.run(ride())


def test_the_step_log_is_read_with_the_replica_key() -> None:
    def replica(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer rk":  # as `sendpath serve` starts it
            return httpx.Response(401, json={"error": {"message": "needs its API key"}})
        return httpx.Response(200, json={"engine": {}, "steps": [{"seq": 1}]})

    async def steps(replica_key: str | None) -> object:
        driver = LoadDriver("http://replica.test", "gateway-key", replica_key)
        driver.client = httpx.AsyncClient(transport=httpx.MockTransport(replica),
                                          headers={"Authorization": "Bearer gateway-key"},
                                          base_url="http://replica.test")  # fmt: skip
        async with driver.client:
            return await driver.steps(0)

    assert asyncio.run(steps("rk")) == {"engine": {}, "steps": [{"seq": 1}]}
    with pytest.raises(ServedProfileError, match="give --replica-api-key"):
        asyncio.run(steps(None))
