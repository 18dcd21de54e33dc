"""The whole stack as `sendpath serve --replicas 2` runs it (real processes, tiny model),
probed as an attacker or a careless client would: no rejected input hurts a replica, a
client that leaves is not served for nobody, replicas answer only the gateway, and half-sent
requests do not hold connections."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import child_pids, start_serve, wait_for

KEY = "replica-key-for-tests"


@dataclass
class Stack:
    url: str
    secret: str
    replicas: list[str]
    proc: subprocess.Popen[str]

    def post(self, body: Any, path: str = "/v1/chat/completions", **kw: Any) -> httpx.Response:
        return _post(self.url + path, body, {"Authorization": f"Bearer {self.secret}"}, **kw)


def _post(url: str, body: Any, headers: dict[str, str], **kw: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**headers, "content-type": "application/json"}
    return httpx.post(url, content=raw, headers=headers, timeout=kw.get("timeout", 60))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("serve-data")
    flags = ("--replica-api-key", KEY, "--request-timeout", "1")
    served = start_serve(tiny_llama_dir, data, *flags)
    assert served.secret is not None
    replicas = [r["url"] for r in httpx.get(served.url + "/fleet").json()["replicas"]]
    yield Stack(served.url, served.secret, replicas, served.proc)
    served.proc.terminate()
    served.proc.wait(30)


def healthy(stack: Stack) -> bool:
    ready = all(httpx.get(r + "/ready").status_code == 200 for r in stack.replicas)
    return ready and httpx.get(stack.url + "/health").json()["healthy"] == 2


def abort_count(replica: str, reason: str = "abort") -> float:
    line = f'sendpath:request_success_total{{finished_reason="{reason}"}} '
    text = httpx.get(replica + "/metrics").text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def running(replica: str) -> int:
    return int(httpx.get(replica + "/load").json()["num_requests_running"])


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "max_tokens": 3}
VOCAB = 49152  # SmolLM2's tokenizer, which the tiny model uses


def _raw(extra: str) -> bytes:
    return b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + extra.encode()


REJECTED: list[tuple[str, str, Any]] = [
    ("NaN temperature", "/v1/chat/completions", _raw('"temperature": NaN}')),
    ("Infinity top_p", "/v1/chat/completions", _raw('"top_p": Infinity}')),
    ("overflowing float", "/v1/chat/completions", _raw('"temperature": 1e999}')),
    ("5000-digit seed", "/v1/chat/completions", _raw('"seed": ' + "9" * 5000 + "}")),
    ("10,000 deep", "/v1/chat/completions", _raw('"x": ' + "[" * 10_000 + "]" * 10_000 + "}")),
    ("negative token id", "/v1/completions", {**COMPLETION, "prompt": [5, -1]}),
    ("token id = vocabulary", "/v1/completions", {**COMPLETION, "prompt": [5, VOCAB]}),
    ("token id past 64 bits", "/v1/completions", {**COMPLETION, "prompt": [5, 2**64 + 3]}),
    ("temperature 3", "/v1/chat/completions", {**CHAT, "temperature": 3.0}),
]
GREEDY = [  # once made NaN probabilities; now sampled greedily
    {**CHAT, "temperature": 1e-300},
    {**CHAT, "temperature": 5e-324, "top_p": 1e-300},
    {**CHAT, "temperature": 1.0, "top_p": 5e-324},
]


@pytest.mark.parametrize(("name", "path", "body"), REJECTED, ids=[r[0] for r in REJECTED])
def test_a_rejected_input_is_a_400_everywhere_and_hurts_no_replica(
    stack: Stack, name: str, path: str, body: Any
) -> None:
    r = stack.post(body, path)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for replica in stack.replicas:  # the same, sent to a replica directly
        direct = _post(replica + path, body, {"Authorization": f"Bearer {KEY}"})
        assert direct.status_code == 400, direct.text
    assert healthy(stack)
    assert stack.post(CHAT).status_code == 200


def test_tiny_temperatures_and_top_p_are_answered_greedily(stack: Stack) -> None:
    answers = {stack.post(body).json()["choices"][0]["message"]["content"] for body in GREEDY}
    assert len(answers) == 1 and healthy(stack)


def test_a_client_that_leaves_a_whole_answer_is_not_served_for_nobody(stack: Stack) -> None:
    before = {r: (abort_count(r), abort_count(r, "length")) for r in stack.replicas}
    port = int(stack.url.rsplit(":", 1)[1])
    body = json.dumps({**CHAT, "max_tokens": 1900, "ignore_eos": True}).encode()
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {stack.secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_for(lambda: sum(running(r) for r in stack.replicas) == 1)  # at a replica now
    c.close()
    wait_for(lambda: sum(abort_count(r) - before[r][0] for r in stack.replicas) == 1)
    assert all(abort_count(r, "length") == before[r][1] for r in stack.replicas)
    wait_for(lambda: httpx.get(stack.url + "/health").json()["in_flight"] == 0)


def test_replicas_answer_only_the_gateway(stack: Stack) -> None:
    for replica in stack.replicas:
        r = httpx.post(replica + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(replica + "/v1/steps").status_code == 401
        assert httpx.get(replica + "/ready").status_code == 200  # the checks stay open
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in child_pids(stack.proc.pid)]
    assert all(KEY.encode() not in c for c in cmdlines)  # passed in the environment


def test_half_sent_requests_do_not_hold_connections(stack: Stack) -> None:
    port = int(stack.url.rsplit(":", 1)[1])
    conns = []
    for _ in range(50):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
        conns.append(c)
    for c in conns:  # closed by the gateway after --request-timeout 1
        c.settimeout(10)
        assert c.recv(1024) == b""
    assert stack.post(CHAT).status_code == 200
