"""The loads `sendpath profile --url` sends, and how a refusal ends them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sendpath.sim.profile import Load
from sendpath.sim.served_loads import LoadDriver, ServedProfileError


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

    with pytest.raises(ServedProfileError, match="refused \\(503\\)"):
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
