"""The seed's three situations on the real server: `sendpath serve` (one replica, the
built-in model, this machine) loaded by `sendpath bench --scenario quiet | overloaded |
long-document`; records each report and which stage dominated. The overloaded scenario
runs twice: with the default batch of 64 sequences, and with the batch bounded at 8
(`--max-num-seqs 8`), because on a CPU the batch size decides what overload looks like.

    .venv/bin/python -m benchmarks.scenarios
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sendpath.fleet import free_port, wait_healthy

RESULTS = Path(__file__).parent / "results" / "scenarios.json"
# (label, scenario, extra `sendpath serve` flags)
RUNS: tuple[tuple[str, str, list[str]], ...] = (
    ("quiet", "quiet", []),
    ("overloaded", "overloaded", []),
    ("overloaded, batch <= 8", "overloaded", ["--max-num-seqs", "8"]),
    ("long-document", "long-document", []),
)


def run(label: str, scenario: str, serve_args: list[str], data: Path) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "SENDPATH_DATA_DIR": str(data)}
    cmd = [sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port), "--no-auth"]
    serve = subprocess.Popen(cmd + serve_args, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy({url: serve}, 300)
        out = data / f"{scenario}.json"
        bench = [sys.executable, "-m", "sendpath.cli", "bench", "--url", url,
                 "--scenario", scenario, "--json", str(out)]  # fmt: skip
        subprocess.run(bench, check=True)
        report: dict[str, Any] = json.loads(out.read_text())
        report["server_flags"] = serve_args
        return report
    finally:
        serve.terminate()
        serve.wait(60)


def main() -> None:
    data = Path(tempfile.mkdtemp(prefix="sendpath-scenarios-"))
    reports = {label: run(label, scenario, flags, data) for label, scenario, flags in RUNS}
    RESULTS.parent.mkdir(exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    RESULTS.write_text(json.dumps({"machine": machine, "reports": reports}, indent=2) + "\n")
    print("\n| scenario | completed | dominant | queue | prefill | decode | other | TTFT p50 ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, r in reports.items():
        st = r["stages"]

        def share(*names: str, stages: dict[str, dict[str, float]] = st) -> str:
            return f"{sum(stages.get(n, {}).get('share', 0.0) for n in names):.0%}"

        grouped = {"gateway.queue", "engine.queue", "prefill", "tokenize", "decode"}
        other = sum(v["share"] for k, v in st.items() if k not in grouped)
        print(
            f"| {name} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{r.get('dominant_stage')} | "
            f"{share('gateway.queue', 'engine.queue')} | {share('prefill', 'tokenize')} | "
            f"{share('decode')} | {other:.0%} | {r['median_ttft_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
