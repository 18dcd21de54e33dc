"""The gateway against replicas that misbehave and clients that do: real HTTP servers that
hang, stall mid-stream, answer 200 with an error, or stream forever; a client that stops
reading; a filter busy with a huge prompt; an unexpected error; one key reusing another's
client id. Nothing here can stop the gateway or hold a slot for ever."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sendpath.config import ConnectionLimits, GatewayConfig
from sendpath.gateway.app import create_gateway_app
from tests.conftest import wait_for
from tests.gateway.conftest import CHAT, gateway
from tests.server.conftest import Server, serve_app

CHUNK = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}


def token(text: str) -> str:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return f"data: {json.dumps({**CHUNK, 'choices': [choice]})}\n\n"


class Mock:
    """A replica that misbehaves on purpose, as ``mode`` says; records what it saw."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.closed = threading.Event()  # its stream's generator was closed (client gone)

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            self.requests += 1
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "error-first":
                error = {"message": "The engine stopped.", "type": "overloaded_error",
                         "param": None, "code": "service_unavailable"}  # fmt: skip
                return StreamingResponse(
                    iter([f"data: {json.dumps({'error': error})}\n\n"]),
                    media_type="text/event-stream",
                )
            if self.mode == "crash-500":
                return Response("Traceback: /opt/internal/secret.py line 3", status_code=500)
            if self.mode == "auth":
                error = {"message": "bad key", "type": "invalid_request_error", "param": None,
                         "code": "invalid_api_key"}  # fmt: skip
                return JSONResponse({"error": error}, status_code=401)
            return StreamingResponse(self._stream(), media_type="text/event-stream")

        async def ok(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok", "object": "list", "data": [{"id": "tiny"}]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/health", ok),
                Route("/v1/models", ok),
            ]
        )

    async def _stream(self) -> AsyncIterator[str]:
        try:
            yield token("Hello")
            if self.mode == "stall":
                await asyncio.sleep(3600)
            while self.mode == "endless":
                yield token(" and more" * 20)
                await asyncio.sleep(0)
        finally:
            self.closed.set()


@contextmanager
def mocked(mode: str) -> Iterator[tuple[Mock, str]]:
    mock = Mock(mode)
    with serve_app(mock.app()) as url:
        yield mock, url


@contextmanager
def front(urls: list[str], tmp_path: Path, **options: Any) -> Iterator[str]:
    options = {"policy": "round_robin", "health_interval_s": 0.2, **options}
    config = GatewayConfig(
        replicas=tuple(urls), data_dir=str(tmp_path), require_keys=False, **options
    )
    limits = options.get("connection")
    with serve_app(create_gateway_app(config), limits) as url:
        yield url


def stream(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())]
        events = [json.loads(x[6:]) if x[6:].startswith("{") else x[6:]
                  for x in r.iter_lines() if x.startswith("data: ")]  # fmt: skip
        return 200, events


def test_a_hung_replica_costs_one_first_token_timeout_then_another_answers(
    replica: Server, tmp_path: Path
) -> None:
    with mocked("hang") as (mock, hung), front([hung, replica.url], tmp_path,
                                               first_token_timeout_s=1.0) as url:  # fmt: skip
        status, events = stream(url, {**CHAT, "max_tokens": 3, "stream": True})
        assert status == 200 and events[-1] == "[DONE]" and mock.requests == 1
    with mocked("hang") as (mock, hung), front([hung], tmp_path, first_token_timeout_s=0.5) as url:
        status, events = stream(url, {**CHAT, "stream": True})
        assert status == 504
        err = events[0]["error"]
        assert err["code"] == "upstream_timeout" and "replica-0" in err["message"]
        assert hung not in json.dumps(err)  # no internal address


def test_a_replica_that_stalls_mid_stream_ends_it_with_an_error_event(tmp_path: Path) -> None:
    with mocked("stall") as (mock, url_), front([url_], tmp_path,
                                                between_tokens_timeout_s=0.5) as url:  # fmt: skip
        status, events = stream(url, {**CHAT, "stream": True})
        assert status == 200 and events[-1] != "[DONE]"
        err = events[-1]["error"]
        assert "sent nothing for 0.5 s" in err["message"] and url_ not in err["message"]
        assert mock.closed.wait(10)  # the stalled upstream was let go


def test_a_200_whose_stream_opens_with_an_error_is_that_error(
    replica: Server, tmp_path: Path
) -> None:
    with mocked("error-first") as (mock, bad), front([bad, replica.url], tmp_path) as url:
        status, events = stream(url, {**CHAT, "max_tokens": 2, "stream": True})
        assert status == 200 and events[-1] == "[DONE]" and mock.requests == 1  # retried
    with mocked("error-first") as (mock, bad), front([bad], tmp_path) as url:
        status, events = stream(url, {**CHAT, "stream": True})
        assert status == 503 and events[0]["error"]["code"] == "service_unavailable"


def test_an_unknown_upstream_5xx_reaches_the_client_without_its_internals(
    tmp_path: Path,
) -> None:
    with mocked("crash-500") as (_, bad), front([bad], tmp_path) as url:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert "secret" not in r.text and bad not in r.text


def test_a_client_that_stops_reading_is_dropped_and_the_upstream_let_go(tmp_path: Path) -> None:
    limits = ConnectionLimits(write_timeout_s=0.5, send_buffer_bytes=4096)
    with mocked("endless") as (mock, up), front([up], tmp_path, connection=limits) as url:
        port = int(url.rsplit(":", 1)[1])
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", port))
        body = json.dumps({**CHAT, "stream": True})
        c.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )  # ...and never reads
        assert mock.closed.wait(20)  # the gateway dropped it and closed the upstream stream
        wait_for(lambda: httpx.get(url + "/health").json()["in_flight"] == 0)
        c.close()


def test_a_stalled_reader_through_the_gateway_returns_the_replica_to_idle(
    replica: Server, tmp_path: Path
) -> None:
    limits = ConnectionLimits(write_timeout_s=0.5, send_buffer_bytes=4096)
    before = _aborted(replica)
    with front([replica.url], tmp_path, connection=limits) as url:
        port = int(url.rsplit(":", 1)[1])
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", port))
        body = json.dumps({**CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True})
        c.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )  # ...and never reads
        wait_for(lambda: _aborted(replica) == before + 1)  # aborted there, not finished
        assert replica.idle()
        c.close()


def _aborted(replica: Server) -> float:
    line = 'sendpath:request_success_total{finished_reason="abort"} '
    text = httpx.get(replica.url + "/metrics").text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_models_answers_from_a_live_replica_when_another_is_dead(
    replica: Server, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    with front([dead, replica.url], tmp_path, health_interval_s=60.0) as url:
        for _ in range(3):
            r = httpx.get(url + "/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


class Blocking:
    """A safety check that holds a large prompt until released (a slow filter)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def check(self, text: str) -> str | None:
        if len(text) > 100_000:
            self.started.set()
            self.release.wait(30)
        return None

    def hold_from(self, text: str, start: int = 0) -> int:
        return len(text)


def test_the_event_loop_serves_others_while_a_huge_prompt_is_checked(
    replica: Server, tmp_path: Path
) -> None:
    check = Blocking()
    with gateway(replica, tmp_path, safety=check) as gw:
        secret = gw.key("big")
        huge = {
            "model": "tiny",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "x" * 200_000}],
        }
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(gw.post(secret, huge)))
        t.start()
        assert check.started.wait(30)  # the check is running, and cannot end yet
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
        assert gw.post(secret, {**CHAT, "max_tokens": 1}).status_code == 200
        check.release.set()
        t.join(60)
        assert answer[0].status_code == 413  # the replica's own body cap (64 KiB) refuses it


class Exploding:
    def check(self, text: str) -> str | None:
        raise RuntimeError("filter failed reading /etc/sendpath/secret-rules.toml")

    def hold_from(self, text: str, start: int = 0) -> int:
        return len(text)


def test_an_unexpected_error_is_a_500_in_openai_shape_with_a_request_id(
    replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path, safety=Exploding()) as gw:
        r = gw.post(gw.key("a"), CHAT)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"
        assert r.headers["x-request-id"] in err["message"] and "secret" not in r.text
        assert httpx.get(gw.url + "/health").status_code == 200


def test_one_key_cannot_see_or_displace_another_keys_progress(tiny: Any, tmp_path: Path) -> None:
    from tests.factories import FaultyRunner
    from tests.server.conftest import serve

    runners: list[FaultyRunner] = []

    def gated(inner: Any) -> FaultyRunner:
        runners.append(FaultyRunner(inner))
        runners[0].gate = threading.Event()  # every step waits: requests stay in flight
        return runners[0]

    with serve(tiny, runner=gated) as slow, gateway(slow, tmp_path) as gw:
        alice, mallory = gw.key("alice"), gw.key("mallory")

        def send(secret: str) -> None:
            headers = {"Authorization": f"Bearer {secret}", "x-sendpath-client-id": "tab-1"}
            httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                       headers=headers, timeout=120)  # fmt: skip

        def progress(secret: str) -> int:
            headers = {"Authorization": f"Bearer {secret}"}
            return httpx.get(gw.url + "/v1/progress/tab-1", headers=headers).status_code

        clients = [threading.Thread(target=send, args=(alice,))]
        clients[0].start()
        wait_for(lambda: progress(alice) == 200)
        assert progress(mallory) == 404  # not hers to see
        clients.append(threading.Thread(target=send, args=(mallory,)))  # the same client id
        clients[1].start()
        wait_for(lambda: progress(mallory) == 200)  # her own entry...
        assert progress(alice) == 200  # ...beside alice's, which is still there
        assert runners[0].gate is not None
        runners[0].gate.set()
        for c in clients:
            c.join(120)
        wait_for(lambda: progress(alice) == progress(mallory) == 404)  # both done


def test_a_stuck_engine_is_reported_and_its_requests_go_elsewhere(
    tiny: Any, replica: Server, tmp_path: Path
) -> None:
    from tests.factories import FaultyRunner
    from tests.server.conftest import serve

    runners: list[FaultyRunner] = []
    exits: list[bool] = []

    def hung(inner: Any) -> FaultyRunner:
        runners.append(FaultyRunner(inner))
        runners[0].gate = threading.Event()  # its steps never end (until the test says)
        return runners[0]

    with (
        serve(
            tiny, runner=hung, stuck_step_s=0.5, on_engine_failure=lambda: exits.append(True)
        ) as stuck,
        front([stuck.url, replica.url], tmp_path) as url,  # round-robin: the stuck one first
    ):
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.headers["x-sendpath-replica"] == "replica-1"
        health = httpx.get(stuck.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "stuck"}
        assert httpx.get(stuck.url + "/ready").status_code == 503
        wait_for(lambda: exits == [True])  # `sendpath replica` exits, and serve restarts it
        assert runners[0].gate is not None
        runners[0].gate.set()


def test_a_replica_that_refuses_the_gateways_key_is_not_the_clients_fault(
    replica: Server, tmp_path: Path
) -> None:
    with mocked("auth") as (mock, locked), front([locked, replica.url], tmp_path) as url:
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and mock.requests == 1  # went on to the other
    with mocked("auth") as (_, locked), front([locked], tmp_path) as url:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 502 and "--replica-api-key" in r.json()["error"]["message"]


def test_routes_and_parameters_that_do_not_exist_get_openai_errors(
    replica: Server, tmp_path: Path
) -> None:
    with front([replica.url], tmp_path) as url:
        for method, path, status, code in [
            ("GET", "/v1/nope", 404, "not_found"),
            ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ]:
            r = httpx.request(method, url + path)
            assert r.status_code == status and r.json()["error"]["code"] == code
        r = httpx.get(url + "/v1/whatif", params={"rate": "lots"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rate"


def test_a_key_with_token_limits_reserves_its_prompts_exact_count(
    replica: Server, tmp_path: Path
) -> None:
    emoji = "\U0001f600\U0001f680\U0001f9e0" * 40  # 120 characters: ~30 tokens at 4 a token
    with gateway(replica, tmp_path) as gw:
        secret = gw.key("counted", tpm=5000)
        body = {"model": "tiny", "prompt": emoji, "max_tokens": 1, "ignore_eos": True}
        r = gw.post(secret, body, "/v1/completions")
        prompt = r.json()["usage"]["prompt_tokens"]
        assert prompt > 120  # byte-level BPE: several tokens an emoji
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 5000 - (prompt + 1)
