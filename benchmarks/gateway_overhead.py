"""What the gateway itself costs a request: a mock upstream, the gateway, and the load, in one run.

The question: with keys, rate limits, the input and output filters and admission all on,
how much latency and CPU does one gateway worker add to a streamed chat request, and how
many requests a second can one worker core carry? The model is taken out of the picture:
the upstream is a mock replica (``mock_replica.py``) that answers every request at once
with a 16-chunk stream in OpenAI's shape (role, 14 text chunks, finish, usage, ``[DONE]``).

Three processes on the same machine: the mock upstream (a bare asyncio server, so its own
cost is small), ``sendpath gateway`` (one worker, a key with limits, safety on), and this
script's load generator (a bare asyncio HTTP/1.1 client, closed loop, keep-alive). Each
measurement runs twice, direct to the mock and through the gateway, at concurrency 1 (the
latency a request sees) and at concurrency 16 (throughput); the gateway's CPU time over a
window, read from ``/proc``, gives its CPU per request and so requests/s per worker core.

    .venv/bin/python benchmarks/gateway_overhead.py            # about a minute
    .venv/bin/python benchmarks/gateway_overhead.py --seconds 20
    .venv/bin/python benchmarks/gateway_overhead.py --otlp     # with span export on
    .venv/bin/python benchmarks/gateway_overhead.py --otlp --sample 0.1
    .venv/bin/python benchmarks/gateway_overhead.py --side-by-side 4 --seconds 6
    .venv/bin/python benchmarks/gateway_overhead.py --side-by-side 6 --seconds 6 --rate 800

Aims (issue 21): at most 1 ms added at p50; at least 1,000 requests/s per worker core.
With ``--otlp`` the gateway exports every request's spans over OTLP/HTTP to a sink this
script serves (it reads and discards them; its CPU is not the gateway's); aim (issue 40):
at most 5% more gateway CPU per request; ``--side-by-side ROUNDS`` measures that ratio in
one run, two gateways (without and with export) loaded at once in each round, so the
host's drift, larger here than the difference, is the same for both; where ``py-spy`` is
installed it also samples the exporting gateway's stacks, in rounds of its own (its
sampling takes CPU), and reports the export path's own CPU over the rest
(``export_extra_cpu_*``), a direct attribution (it leaves out indirect costs such as more
garbage collection). With ``--rate`` both get the same requests a second (an open loop);
in the closed loop the slower one also gets fewer, which costs it CPU per request too.
Results: ``benchmarks/results/gateway_overhead.json`` (``gateway_overhead_otlp_<ratio>.json``,
``gateway_overhead_otlp_side_by_side_<ratio>_c<concurrency>.json`` or ``_r<rate>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gateway_overhead.json"


@dataclass
class Load:
    """``concurrency`` keep-alive connections, each one request at a time: a closed loop,
    or with ``rate``, an open one (requests due at that rate, each taken by a free
    connection; ones due while all are busy wait for one)."""

    port: int
    body: bytes
    headers: str

    async def one_connection(
        self, until: float, latencies: list[float], due: asyncio.Queue[None] | None
    ) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n{self.headers}"
            f"content-type: application/json\r\ncontent-length: {len(self.body)}\r\n\r\n"
        ).encode() + self.body
        try:
            while time.perf_counter() < until:
                if due is not None:  # an open loop: the next request due
                    try:
                        await asyncio.wait_for(due.get(), until - time.perf_counter())
                    except TimeoutError:
                        break
                start = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"not a 200: {head[:200]!r}")
                body = await reader.readuntil(b"\r\n0\r\n\r\n")  # the last chunk
                if b"data: [DONE]" not in body:
                    raise RuntimeError(f"the stream did not finish: {body[-300:]!r}")
                latencies.append(time.perf_counter() - start)
        finally:
            writer.close()

    async def run(self, concurrency: int, seconds: float, rate: float | None = None) -> list[float]:
        latencies: list[float] = []
        until = time.perf_counter() + seconds
        due: asyncio.Queue[None] | None = None if rate is None else asyncio.Queue()
        clients = [self.one_connection(until, latencies, due) for _ in range(concurrency)]
        if due is not None and rate is not None:
            clients.append(_due_at(rate, until, due))
        await asyncio.gather(*clients)
        return latencies


async def _due_at(rate: float, until: float, due: asyncio.Queue[None]) -> None:
    """A request due every 1/``rate`` s until ``until`` (late ones at once)."""
    start, n = time.perf_counter(), 0
    while (now := time.perf_counter()) < until:
        wait = start + n / rate - now
        if wait > 0:
            await asyncio.sleep(wait)
        due.put_nowait(None)
        n += 1


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    load: Load, concurrency: int, seconds: float, pid: int | None, rate: float | None = None
) -> dict[str, Any]:
    asyncio.run(load.run(concurrency, min(2.0, seconds / 4), rate))  # warm: connections, caches
    cpu0 = cpu_seconds(pid) if pid else 0.0
    start = time.perf_counter()
    latencies = asyncio.run(load.run(concurrency, seconds, rate))
    wall = time.perf_counter() - start
    cpu = cpu_seconds(pid) - cpu0 if pid else None
    latencies.sort()
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1e3, 3),
    }
    if cpu is not None:
        out["gateway_cpu_ms_per_request"] = round(cpu / len(latencies) * 1e3, 3)
        out["requests_per_s_per_gateway_core"] = round(len(latencies) / cpu, 1)
    return out


def wait_ready(port: int, path: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered on port {port}")


def span_sink() -> str:
    """An OTLP/HTTP endpoint in this process that takes every export and drops it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as collectors do

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def start_gateway(
    port: int, mock_port: int, data_dir: str, sink: str | None, sample: float
) -> subprocess.Popen[bytes]:
    """``sendpath gateway`` in front of the mock (exporting spans to ``sink`` if given)."""
    otlp = ["--otlp-traces-endpoint", sink] if sink is not None else []
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "sendpath"),
            "gateway",
            "--port",
            str(port),
            "--replica",
            f"http://127.0.0.1:{mock_port}",
            "--data-dir",
            data_dir,
            "--max-inflight-per-replica",
            "64",
            *otlp,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={
            **os.environ,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(sample),
        },
    )


def measure_together(
    loads: tuple[Load, Load],
    concurrency: int,
    seconds: float,
    pids: tuple[int, int],
    rate: float | None,
) -> tuple[float, float, list[int]]:
    """Both loads at once, ``concurrency`` connections each (at ``rate`` requests/s each,
    if given), over the same window: each gateway's CPU ms per request (the host's drift
    is the same for both), and the requests each served."""

    async def both(seconds: float) -> list[list[float]]:
        runs = (load.run(concurrency, seconds, rate) for load in loads)
        return list(await asyncio.gather(*runs))

    asyncio.run(both(min(2.0, seconds / 4)))  # warm: connections, caches
    cpu0 = [cpu_seconds(pid) for pid in pids]
    done = asyncio.run(both(seconds))
    cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
    off, on = (c / len(lat) * 1e3 for c, lat in zip(cpu, done, strict=True))
    return round(off, 4), round(on, 4), [len(lat) for lat in done]


def side_by_side(
    gateways: tuple[tuple[int, int], tuple[int, int]],
    body: bytes,
    secrets: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Gateway CPU per request without and with export (``gateways``: their port and
    pid), both loaded at once at ``--concurrency`` each in each round, so both see the
    same host; the exporting one is sampled by py-spy in rounds of its own."""
    rounds: dict[str, dict[str, list[Any]]] = {
        k: {"off": [], "on": [], "share": [], "served": []} for k in secrets
    }
    pieces: dict[str, Counter[str]] = {k: Counter() for k in secrets}
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    pids = (gateways[0][1], gateways[1][1])
    for _ in range(args.side_by_side):
        for kind, secret in secrets.items():
            header = f"authorization: Bearer {secret}\r\n"
            loads = (Load(gateways[0][0], body, header), Load(gateways[1][0], body, header))
            off, on, served = measure_together(
                loads, args.concurrency, args.seconds, pids, args.rate
            )
            rounds[kind]["off"].append(off)
            rounds[kind]["on"].append(on)
            rounds[kind]["served"].append(served)
            if spy is not None:  # py-spy takes CPU of its own: not in the rounds compared
                with sampled(spy, pids[1], args.seconds, pieces[kind]) as share:
                    measure(loads[1], args.concurrency, args.seconds, pids[1], args.rate)
                rounds[kind]["share"] += share
    out: dict[str, Any] = {
        "concurrency": args.concurrency,
        "rate_per_gateway": args.rate,
        "py_spy": spy is not None,
    }
    for kind, pair in rounds.items():
        ratios = [on / off for off, on in zip(pair["off"], pair["on"], strict=True)]
        out[f"{kind}_key"] = {
            "cpu_ms_per_request_off": pair["off"],
            "cpu_ms_per_request_on": pair["on"],
            "ratio_per_round": [round(r, 3) for r in ratios],
            "ratio_median": round(statistics.median(ratios), 3),
            "served_per_round": pair["served"],
        }
        if args.rate:  # an open loop is only fair while both keep up with it
            due = args.rate * args.seconds
            held = all(min(served) >= 0.99 * due for served in pair["served"])
            out[f"{kind}_key"]["rate_held"] = held
            if not held:
                print(
                    f"warning: {kind} key: a gateway served fewer than 99% of the "
                    f"{due:.0f} requests due in a round: lower --rate",
                    file=sys.stderr,
                )
        if pair["share"]:  # export's CPU over the rest of the exporting gateway's
            extra = [s / (1 - s) for s in pair["share"]]
            out[f"{kind}_key"]["export_extra_cpu_per_round"] = [round(e, 4) for e in extra]
            out[f"{kind}_key"]["export_extra_cpu_median"] = round(statistics.median(extra), 4)
            total = pieces[kind].pop("(all samples)")
            out[f"{kind}_key"]["export_share_by_entry"] = {
                entry: round(n / total, 4) for entry, n in pieces[kind].most_common(8)
            }
    return out


# frames that run only when exporting: the trace context, building, encoding, queueing
# and sending spans (not ``telemetry/genai_metrics.py`` or ``genai.operation_of``: the
# GenAI metrics and the operation's name are kept with export off too)
EXPORT_FRAMES = (
    "sendpath/telemetry/export.py",
    "sendpath/telemetry/otlp.py",
    "sendpath/telemetry/sampling.py",
    "sendpath/telemetry/spans.py",
    "sendpath/telemetry/trace_context.py",
    "sendpath/gateway/spans.py",
    "opentelemetry/",
)


@contextlib.contextmanager
def sampled(
    spy: str | None, pid: int, seconds: float, pieces: Counter[str]
) -> Iterator[list[float]]:
    """With ``spy`` (py-spy's path), sample ``pid``'s stacks while the block runs and
    append the share of its CPU samples that are in the export path (``EXPORT_FRAMES``):
    a direct attribution, steadier than two CPU totals on a drifting host. ``pieces``
    counts the export path's samples by where they enter it (the outermost such frame)."""
    share: list[float] = []
    if spy is None:
        yield share
        return
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        command = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw"]
        command += ["--nonblocking", "-o", raw.name, "--duration", str(int(seconds + 3))]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield share
        finally:
            proc.wait(seconds + 30)
        total = export = 0
        for line in Path(raw.name).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():  # not a stack: a line py-spy says something on
                continue
            total += int(count)
            entry = next((f for f in stack.split(";") if any(e in f for e in EXPORT_FRAMES)), None)
            if entry is not None:
                export += int(count)
                name, _, where = entry.partition(" (")  # "function (path:line)"
                pieces[f"{name} ({'/'.join(where.split(':')[0].split('/')[-2:])})"] += int(count)
        if total:
            share.append(export / total)
            pieces["(all samples)"] += total


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, then a kill if it has not ended in 10 s (nothing is left running)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    from sendpath.model.quant import cpu_model  # torch with it: not in the load's way

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement (10)")
    parser.add_argument("--concurrency", type=int, default=16, help="for throughput (16)")
    parser.add_argument("--otlp", action="store_true", help="the gateway exports its spans")
    parser.add_argument(
        "--sample", type=float, default=1.0, help="with --otlp: the traces' head-sampling ratio"
    )
    parser.add_argument(
        "--side-by-side",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="two gateways, without and with --otlp export, measured in alternating rounds "
        "at --concurrency: gateway CPU per request and the ratio, in one run",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="with --side-by-side: requests/s sent to each gateway (an open loop, so both "
        "serve the same load) instead of a closed loop at --concurrency",
    )
    args = parser.parse_args()
    if args.rate is not None and (args.rate <= 0 or not args.side_by_side):
        parser.error("--rate takes a positive number of requests/s, with --side-by-side")
    sys.path.insert(0, str(ROOT))
    from benchmarks.mock_replica import PROMPT
    from sendpath.fleet import free_port
    from sendpath.gateway.keys import KeyStore

    mock_port, gateway_port = free_port(), free_port()
    body = json.dumps(
        {
            "model": "mock",
            "stream": True,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": PROMPT}],
        }
    ).encode()
    with tempfile.TemporaryDirectory() as data_dir:
        store = KeyStore(Path(data_dir))
        secrets = {  # a key without limits; one with all three (its prompts counted exactly)
            "open": store.create("open")[1],
            "limited": store.create("limited", rpm=10**9, tpm=10**12, daily_tokens=10**12)[1],
        }
        mock = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from benchmarks.mock_replica import run_mock; run_mock({mock_port})",
            ],
            cwd=ROOT,
        )
        sink = span_sink() if args.otlp or args.side_by_side else None
        gateway = start_gateway(
            gateway_port, mock_port, data_dir, sink if args.otlp else None, args.sample
        )
        exporting = None
        if args.side_by_side:
            exporting_port = free_port()
            exporting = start_gateway(exporting_port, mock_port, data_dir, sink, args.sample)
        try:
            wait_ready(mock_port, "/health", mock)
            wait_ready(gateway_port, "/health", gateway)
            if exporting is not None:
                wait_ready(exporting_port, "/health", exporting)
                pair = ((gateway_port, gateway.pid), (exporting_port, exporting.pid))
                compared = side_by_side(pair, body, secrets, args)
                name = f"gateway_overhead_otlp_side_by_side_{args.sample:g}"
                name += f"_r{args.rate:g}.json" if args.rate else f"_c{args.concurrency}.json"
                result = {
                    "cpu": cpu_model(),
                    "cpu_count": os.cpu_count(),
                    "seconds": args.seconds,
                    **compared,
                }
                RESULTS.with_name(name).write_text(json.dumps(result, indent=2) + "\n")
                print(json.dumps(result, indent=2))
                return
            direct = Load(mock_port, body, "")
            rows = {}
            for concurrency in (1, args.concurrency):
                rows[f"direct_c{concurrency}"] = measure(direct, concurrency, args.seconds, None)
                for kind, secret in secrets.items():
                    through = Load(gateway_port, body, f"authorization: Bearer {secret}\r\n")
                    rows[f"{kind}_key_c{concurrency}"] = measure(
                        through, concurrency, args.seconds, gateway.pid
                    )
        finally:  # the gateways first: the mock waits for their connections to close
            for proc in (gateway, exporting, mock):
                if proc is not None:
                    stop(proc)
    c = args.concurrency
    summary = {
        f"{kind}_key": {
            "added_p50_ms_at_c1": round(
                rows[f"{kind}_key_c1"]["p50_ms"] - rows["direct_c1"]["p50_ms"], 3
            ),
            "requests_per_s_per_gateway_core": rows[f"{kind}_key_c{c}"][
                "requests_per_s_per_gateway_core"
            ],
            "throughput_ratio_to_direct": round(
                rows[f"{kind}_key_c{c}"]["requests_per_s"] / rows[f"direct_c{c}"]["requests_per_s"],
                3,
            ),
        }
        for kind in secrets
    }
    result = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "seconds": args.seconds,
        "otlp": args.otlp,
        "sample": args.sample if args.otlp else None,
        "summary": summary,
        **rows,
    }
    name = f"gateway_overhead_otlp_{args.sample:g}.json" if args.otlp else RESULTS.name
    out = RESULTS.with_name(name)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'run':<18}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'gw CPU ms/req':>15}")
    for name, row in rows.items():
        cpu = row.get("gateway_cpu_ms_per_request", "")
        print(f"{name:<18}{row['requests_per_s']:>9}{row['p50_ms']:>9}{row['p99_ms']:>9}{cpu:>15}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
