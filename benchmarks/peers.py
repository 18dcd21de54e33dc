"""sendpath beside llama.cpp's server and vLLM-CPU: the same GGUF, the same load, one run.

The question: on this machine, how does ``sendpath replica`` (in the configuration
``make serve`` runs: ``--dtype auto --quantization auto``) compare with the servers a
user would otherwise pick for the built-in model, and how close does each get to what the
machine can do at all? Each server is started alone on the idle machine, warmed up, driven
through ``sendpath bench`` (OpenAI streaming chat, ``ignore_eos``, greedy) on the issue's
four workloads, and stopped before the next starts:

    a: 128 in / 128 out, 1 at a time     b: the same, 8 at a time
    c: the same, 32 at a time            d: 1024 in / 32 out, 4 at a time

The peers come from ``../shared/peers/setup.sh`` (about 20 minutes, once; not in CI) under
``$PEERS_DIR`` (default ``~/.cache/sendpath-peers``); a peer that is not installed is
listed as such and left out of the ratios. The machine's roofs are measured in the same
run: memory bandwidth (copying a 1 GiB tensor) and matmul FLOP/s (2048 x 2048, float32,
and bfloat16 where the CPU computes it natively). Each engine's share of them: batch-1
decode's bytes per token over the bandwidth (weights only: a lower bound on what it
reads), and under load its matmul FLOP/s (2 x parameters per output token) over the
faster matmul roof. vLLM runs bfloat16 where the CPU computes it, else float32.

    .venv/bin/python benchmarks/peers.py                 # about 3 minutes per server
    .venv/bin/python benchmarks/peers.py --only sendpath vLLM-CPU

``sendpath-int8`` is sendpath again with ``--kv-cache-dtype int8`` (an option, not the
default), beside the default configuration.

Results: ``benchmarks/results/peers.json`` and a table of ratios on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "peers.json"
PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "sendpath-peers"))
MODEL_NAME = "smollm2"
PARAMETERS = 134.5e6  # SmolLM2-135M, tied embeddings counted once


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_requests: int


WORKLOADS = (
    Workload("a", 128, 128, 1, 8),
    Workload("b", 128, 128, 8, 32),
    Workload("c", 128, 128, 32, 64),
    Workload("d", 1024, 32, 4, 16),
)


@dataclass
class Server:
    """How to start one server, and how many bytes of weights its batch-1 decode reads."""

    name: str
    argv: list[str]
    port: int
    weight_bytes: float
    ready: str = "/health"  # answers 200 once the model is loaded
    env: dict[str, str] = field(default_factory=dict)
    missing: str | None = None  # why it cannot run here


def builtin_gguf() -> Path:
    from sendpath.model.loader import builtin_model_path

    return builtin_model_path()


def servers() -> list[Server]:
    from sendpath.model.quant import native_bf16

    gguf = builtin_gguf()
    cores = os.cpu_count() or 1
    sendpath = Server(
        "sendpath",
        [
            str(Path(sys.executable).parent / "sendpath"),
            "replica",
            "--port",
            "8203",
            "--served-model-name",
            MODEL_NAME,
        ],
        8203,
        gguf.stat().st_size,  # Q4_1 codes kept as they ship (int4), int8 head
        ready="/ready",
    )
    # the same with the int8 KV cache (an option: the default keeps the model's dtype)
    int8 = Server(
        "sendpath-int8",
        [*sendpath.argv[:3], "8204", *sendpath.argv[4:], "--kv-cache-dtype", "int8"],
        8204,
        sendpath.weight_bytes,
        ready="/ready",
    )
    llama_bin = PEERS / "llama.cpp-build" / "bin" / "llama-server"
    llama = Server(
        "llama.cpp",
        [
            str(llama_bin),
            "-m",
            str(PEERS / "model" / gguf.name),
            "--host",
            "127.0.0.1",
            "--port",
            "8202",
            "-c",
            "16384",
            "-np",
            "32",
            "-kvu",
            "-cb",
            "-t",
            str(cores),
            "-a",
            MODEL_NAME,
        ],
        8202,
        gguf.stat().st_size,
        missing=None if llama_bin.exists() else f"not installed ({llama_bin})",
    )
    vllm_python = PEERS / "venv-vllm" / "bin" / "python"
    # vLLM's bfloat16 where the CPU computes it; where torch emulates it (AVX2 without
    # AVX-512 BF16) vLLM runs float32, as sendpath's --dtype auto does there
    vllm_dtype = "bfloat16" if native_bf16() else "float32"
    vllm = Server(
        "vLLM-CPU",
        [
            str(vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(PEERS / "model" / "smollm2-hf"),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            vllm_dtype,
            "--host",
            "127.0.0.1",
            "--port",
            "8201",
        ],
        8201,
        PARAMETERS * (2 if vllm_dtype == "bfloat16" else 4),
        env={
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "HF_HUB_OFFLINE": "1",
            "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
            f"{PEERS / 'venv-vllm' / 'lib' / 'libiomp5.so'}",
        },
        missing=None if vllm_python.exists() else f"not installed ({vllm_python})",
    )
    return [sendpath, int8, llama, vllm]


def roofs() -> dict[str, float]:
    """What this machine can do at all: copy bandwidth and matmul throughput."""

    def best(fn: Any, repeat: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def copy_gb_per_s() -> float:
        source = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32: read once, written once
        target = torch.empty_like(source)
        return 2 * source.numel() * 4 / best(lambda: target.copy_(source)) / 1e9

    from sendpath.model.quant import native_bf16

    out = {"memory_gb_per_s": round(copy_gb_per_s(), 1)}
    n = 2048
    # bfloat16 only where the CPU computes it (elsewhere torch emulates it, for minutes)
    for dtype in (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        seconds = best(lambda a=a, b=b: torch.mm(a, b))
        out[f"matmul_{str(dtype).removeprefix('torch.')}_gflop_per_s"] = round(
            2 * n**3 / seconds / 1e9, 1
        )
    return out


def wait_up(server: Server, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 600
    url = f"http://127.0.0.1:{server.port}{server.ready}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{server.name} did not answer {url} within 600 s")


def bench(server: Server, w: Workload, out: Path) -> dict[str, Any]:
    """One workload through `sendpath bench`; its JSON report."""
    argv = [
        str(Path(sys.executable).parent / "sendpath"),
        "bench",
        "--url",
        f"http://127.0.0.1:{server.port}",
        "--model",
        MODEL_NAME,
        "--concurrency",
        str(w.concurrency),
        "--num-requests",
        str(w.num_requests),
        "--input-len",
        str(w.input_len),
        "--output-len",
        str(w.output_len),
        "--json",
        str(out),
    ]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"})
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def run_server(server: Server, work: Path) -> dict[str, Any]:
    log = work / f"{server.name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            server.argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **server.env}
        )
    rows: dict[str, Any] = {}
    try:
        wait_up(server, proc, log)
        bench(server, Workload("warm-up", 16, 8, 2, 4), work / "warm.json")
        for w in WORKLOADS:
            report = bench(server, w, work / f"{server.name}-{w.name}.json")
            rows[w.name] = {
                "output_tok_per_s": round(report["output_throughput"], 1),
                "requests_per_s": round(report["request_throughput"], 3),
                "median_tpot_ms": round(report["median_tpot_ms"], 2),
                "median_ttft_ms": round(report["median_ttft_ms"], 1),
                "failed": report["failed"],
            }
            print(server.name, w.name, json.dumps(rows[w.name]), flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return rows


def shares(server: Server, rows: dict[str, Any], roof: dict[str, float]) -> dict[str, float]:
    tpot_s = rows["a"]["median_tpot_ms"] / 1e3
    flops = 2 * PARAMETERS * rows["c"]["output_tok_per_s"]
    fastest = max(v for k, v in roof.items() if "matmul" in k)  # bfloat16 where native
    return {
        "decode_bandwidth_share_at_1": round(
            server.weight_bytes / tpot_s / 1e9 / roof["memory_gb_per_s"], 3
        ),
        "matmul_share_at_32": round(flops / 1e9 / fastest, 3),
    }


def table(results: dict[str, Any]) -> str:
    """One markdown table: each engine's figures, then each sendpath configuration's over
    the best peer."""
    engines = [n for n, r in results["servers"].items() if "rows" in r]
    ours = [n for n in engines if n.startswith("sendpath")]
    peers = [n for n in engines if n not in ours]
    lines = [
        "| workload | "
        + " | ".join(engines)
        + "".join(f" | {n} / best peer" for n in ours or ["sendpath"])
        + " |",
        "|---|" + "---:|" * (len(engines) + max(len(ours), 1)),
    ]
    for w in WORKLOADS:
        metric = "requests_per_s" if w.name == "d" else "output_tok_per_s"
        values = {n: results["servers"][n]["rows"][w.name][metric] for n in engines}
        cells = [str(values[n]) for n in engines]
        if w.name == "a":
            tpots = {n: results["servers"][n]["rows"]["a"]["median_tpot_ms"] for n in engines}
            cells = [f"{values[n]} ({tpots[n]} ms)" for n in engines]
        best = max((values[n] for n in peers), default=None)
        ratios = [f"{values[n] / best:.2f}x" if best else "-" for n in ours] or ["-"]
        label = f"{w.name}: {w.input_len}/{w.output_len} at {w.concurrency}"
        label += " (req/s)" if w.name == "d" else ""
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="server names to run")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    names = [server.name for server in servers()]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:  # it would run nothing for them and exit 0
        parser.error(f"unknown server {', '.join(unknown)}: the servers are {', '.join(names)}")
    roof = roofs()
    print("roofs", json.dumps(roof), flush=True)
    from sendpath.model.kernels import cpu_kernels
    from sendpath.model.quant import cpu_features, cpu_model, matrix_engine

    results: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "cpu_features": sorted(k for k, v in cpu_features().items() if v),
            "matrix_engine": matrix_engine(cpu_kernels()),
        },
        "torch": torch.__version__,
        "roofs": roof,
        "servers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for server in servers():
            if args.only and server.name not in args.only:
                continue
            if server.missing is not None:
                results["servers"][server.name] = {"missing": server.missing}
                print(server.name, server.missing, flush=True)
                continue
            rows = run_server(server, Path(tmp))
            results["servers"][server.name] = {
                "rows": rows,
                "shares": shares(server, rows, roof),
            }
    results["table"] = table(results)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(results["table"])


if __name__ == "__main__":
    main()
