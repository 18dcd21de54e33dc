"""Schemathesis over the published OpenAPI documents of a real replica and a real gateway in
front of it (tiny model): valid and invalid requests drawn from the schemas, a bounded
number per operation, deterministic. No answer may be a 5xx, and the fleet must be healthy
and idle afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from sendpath.config import GatewayConfig
from sendpath.gateway.app import create_gateway_app
from sendpath.model.loader import LoadedModel
from tests.server.conftest import Server, serve, serve_app

EXAMPLES = 30  # per operation and mode: enough to reach every field, a few seconds each


class Fleet:
    def __init__(self, replica: Server, gateway: str, secret: str) -> None:
        self.replica, self.gateway, self.secret = replica, gateway, secret


@pytest.fixture(scope="module")
def fleet(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serve(tiny) as replica:
        config = GatewayConfig(
            replicas=(replica.url,),
            data_dir=str(tmp_path_factory.mktemp("fuzz")),
            default_max_tokens=8,
        )
        app = create_gateway_app(config)
        with serve_app(app) as url:
            yield Fleet(replica, url, app.state.keys.create("fuzzer")[1])
    # (the fleet's health is checked by the last test)


def fuzz(url: str, headers: dict[str, str], skip: tuple[str, ...] = ()) -> dict[str, set[int]]:
    """Every operation of ``url``'s OpenAPI document, ``EXAMPLES`` valid and ``EXAMPLES``
    invalid requests each (hypothesis, derandomized); returns the status codes each
    operation answered. A 5xx fails the test with the request that caused it."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        if operation.path in skip:
            continue
        statuses = seen.setdefault(f"{operation.method.upper()} {operation.path}", set())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _examples(operation, mode, headers, statuses)()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE, operation.path
    return seen


def _examples(
    operation: Any, mode: GenerationMode, headers: dict[str, str], statuses: set[int]
) -> Any:
    """The hypothesis test of one operation in one mode (call it to run it)."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        aim(case)
        response = case.call_and_validate(checks=[not_a_server_error], headers=headers, timeout=60)
        statuses.add(response.status_code)

    return run


UNSUPPORTED = ("n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "echo")


def aim(case: Any) -> None:
    """Three bodies in four are aimed at the engine: they name the served model and leave
    out what this server refuses (else nearly all would end at 404 or 400). Every body asks
    for few tokens (else a valid one may generate up to the context's end)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if len(json.dumps(body, default=str)) % 4:
        if "model" in body:
            body["model"] = "tiny"
        for field in UNSUPPORTED:
            body.pop(field, None)
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = min(body[field], 8)
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", 8)


def test_the_replica_never_answers_5xx(fleet: Fleet) -> None:
    seen = fuzz(fleet.replica.url, {})
    for generation in ("POST /v1/chat/completions", "POST /v1/completions", "POST /detokenize"):
        assert {200, 400} <= seen[generation]  # answered, and refused


def test_the_gateway_never_answers_5xx(fleet: Fleet) -> None:
    headers = {"Authorization": f"Bearer {fleet.secret}"}
    seen = fuzz(fleet.gateway, headers, skip=("/v1/whatif",))  # a simulation: tested apart
    for generation in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert {200, 400} <= seen[generation]
    assert seen["GET /fleet"] == {200}


def test_the_fleet_is_healthy_and_idle_after_fuzzing(fleet: Fleet) -> None:
    assert fleet.replica.idle()
    assert httpx.get(fleet.replica.url + "/ready").status_code == 200
    health = httpx.get(fleet.gateway + "/health").json()
    assert health["healthy"] == 1 and health["in_flight"] == 0
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {fleet.secret}"}
    r = httpx.post(fleet.gateway + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200
