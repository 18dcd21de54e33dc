"""The replica under hostile or unlucky traffic: a client that stops reading, a step that
takes long, a request the engine cannot compute, a device that fails, a missing API key,
an unexpected error. Each case ends with the replica idle and answering."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any
from urllib.parse import urlparse

import httpx

from sendpath.config import ConnectionLimits
from sendpath.model.loader import LoadedModel
from sendpath.runner.model_runner import ModelRunner
from tests.conftest import wait_for
from tests.factories import POISON, FaultyRunner
from tests.server.conftest import Server, serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def metric(server: Server, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    line = f'sendpath:request_success_total{{finished_reason="{reason}"}} '
    found = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    return found[0] if found else 0.0


def test_a_client_that_stops_reading_a_stream_is_dropped_and_its_request_aborted(
    tiny: LoadedModel,
) -> None:
    limits = ConnectionLimits(write_timeout_s=0.5, send_buffer_bytes=4096)
    with serve(tiny, limits=limits) as server:
        url = urlparse(server.url)
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect((url.hostname, url.port))
        body = json.dumps({**CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True})
        c.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )  # ...and never reads
        wait_for(lambda: metric(server, "abort") == 1)
        assert server.idle() and metric(server, "length") == 0
        c.close()


def test_load_and_health_answer_while_a_step_runs(tiny: LoadedModel) -> None:
    faulty: list[FaultyRunner] = []

    def wrap(inner: ModelRunner) -> FaultyRunner:
        faulty.append(FaultyRunner(inner))
        return faulty[0]

    with serve(tiny, runner=wrap) as server:
        runner = faulty[0]
        runner.gate = threading.Event()
        answer: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: answer.append(
                httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60)
            )
        )
        client.start()
        assert runner.in_step.wait(30)  # a step is running and cannot end until the gate opens
        load = httpx.get(f"{server.url}/load", timeout=5)
        assert load.status_code == 200 and load.json()["num_requests_running"] in (0, 1)
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
        runner.gate.set()
        client.join(60)
        assert answer[0].status_code == 200


def test_a_request_the_engine_cannot_compute_fails_alone(tiny: LoadedModel) -> None:
    with serve(tiny, runner=FaultyRunner) as server:
        bad = {"model": "tiny", "prompt": [5, POISON, 6], "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/completions", json=bad, timeout=60)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "request_failed" and err["type"] == "server_error"
        assert "index out of range" not in r.text  # the exception stays in the log
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**bad, "stream": True}, timeout=60
        ) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        assert events[-1]["error"]["code"] == "request_failed"
        ok = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert ok.status_code == 200
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert server.idle() and metric(server, "error") == 2


def test_a_failed_device_stops_the_engine_without_leaking_its_error(tiny: LoadedModel) -> None:
    faulty: list[FaultyRunner] = []
    failures: list[bool] = []

    def wrap(inner: ModelRunner) -> FaultyRunner:
        faulty.append(FaultyRunner(inner))
        return faulty[0]

    with serve(tiny, runner=wrap, on_engine_failure=lambda: failures.append(True)) as server:
        faulty[0].device_ok = False
        r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "CUDA" not in r.text and "0xdeadbeef" not in r.text
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.get(f"{server.url}/ready").status_code == 503
        wait_for(lambda: failures == [True])  # `sendpath replica` exits on this


def test_an_api_key_guards_generation_but_not_health(tiny: LoadedModel) -> None:
    with serve(tiny, api_key="s3cret") as server:
        for path, body in (("/v1/chat/completions", CHAT), ("/detokenize", {"tokens": [5]})):
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            wrong = httpx.post(server.url + path, json=body, headers=_bearer("s3cres"))
            assert wrong.status_code == 401
            assert httpx.post(server.url + path, json=body, headers=_bearer("s3cret")).is_success
        assert httpx.get(server.url + "/v1/models").status_code == 401
        for open_path in ("/health", "/ready", "/load", "/metrics"):
            assert httpx.get(server.url + open_path).status_code == 200


def test_detokenize_checks_the_vocabulary(server: Server) -> None:
    vocab = server.core.tokenizer.vocab_size
    ids = server.core.tokenizer.encode("hello world", add_special_tokens=False)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, vocab]})
    assert r.status_code == 400 and "outside this model's vocabulary" in r.text


def test_unexpected_errors_are_500s_in_openai_shape_with_a_request_id(server: Server) -> None:
    # a tokenizer failure no input check foresaw: the request fails, the replica does not
    tokenizer: Any = server.core.tokenizer
    real = tokenizer.encode_chat

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("template exploded at /srv/secret/path")

    tokenizer.encode_chat = broken
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60)
    finally:
        tokenizer.encode_chat = real
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert r.headers["x-request-id"] in err["message"]
    assert "secret" not in r.text and "exploded" not in r.text
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60).is_success


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
