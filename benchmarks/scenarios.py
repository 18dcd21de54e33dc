"""The seed's three situations on the real server: `sendpath serve` (one replica, the
built-in model, this machine) loaded by `sendpath bench --scenario quiet | overloaded |
long-document`; records each report and which stage dominated.

    .venv/bin/python -m benchmarks.scenarios
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sendpath.fleet import free_port

RESULTS = Path(__file__).parent / "results" / "scenarios.json"
SCENARIOS = ("quiet", "overloaded", "long-document")


def main() -> None:
    data = Path(tempfile.mkdtemp(prefix="sendpath-scenarios-"))
    port = free_port()
    env = {**os.environ, "SENDPATH_DATA_DIR": str(data)}
    serve = subprocess.Popen(
        [sys.executable, "-m", "sendpath.cli", "serve", "--port", str(port), "--no-auth"],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    reports = {}
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and serve.poll() is None, "serve did not start"
            time.sleep(0.5)
        for scenario in SCENARIOS:
            out = data / f"{scenario}.json"
            cmd = [sys.executable, "-m", "sendpath.cli", "bench", "--url", url,
                   "--scenario", scenario, "--json", str(out)]  # fmt: skip
            subprocess.run(cmd, check=True)
            reports[scenario] = json.loads(out.read_text())
    finally:
        serve.terminate()
        serve.wait(60)
    RESULTS.parent.mkdir(exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    RESULTS.write_text(json.dumps({"machine": machine, "reports": reports}, indent=2) + "\n")
    print("\n| scenario | requests | dominant | queue | prefill | decode | other | TTFT p50 ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, r in reports.items():
        st = r["stages"]

        def share(*names: str, stages: dict[str, dict[str, float]] = st) -> str:
            return f"{sum(stages.get(n, {}).get('share', 0.0) for n in names):.0%}"

        grouped = {"gateway.queue", "engine.queue", "prefill", "tokenize", "decode"}
        other = sum(v["share"] for k, v in st.items() if k not in grouped)
        print(
            f"| {name} | {r['completed']} | {r.get('dominant_stage')} | "
            f"{share('gateway.queue', 'engine.queue')} | {share('prefill', 'tokenize')} | "
            f"{share('decode')} | {other:.0%} | {r['median_ttft_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
