"""benchmarks/peers.py refuses an --only name it does not know (it ran nothing and exited 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_unknown_only_name_is_an_error_that_lists_the_servers() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--only", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    servers = "sendpath, sendpath-int8, llama.cpp, vLLM-CPU"
    assert f"unknown server vllm: the servers are {servers}" in done.stderr


def test_the_table_has_a_ratio_for_each_sendpath_configuration() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import WORKLOADS, table

    def rows(x: float) -> dict[str, dict[str, float]]:
        return {
            w.name: {"output_tok_per_s": x, "requests_per_s": x / 100, "median_tpot_ms": 5.0}
            for w in WORKLOADS
        }

    found = {
        "servers": {
            "sendpath": {"rows": rows(600.0)},
            "sendpath-int8": {"rows": rows(660.0)},
            "llama.cpp": {"missing": "not installed"},
            "vLLM-CPU": {"rows": rows(500.0)},
        }
    }
    lines = table(found).splitlines()
    assert lines[0] == (
        "| workload | sendpath | sendpath-int8 | vLLM-CPU | sendpath / best peer "
        "| sendpath-int8 / best peer |"
    )
    assert lines[4] == "| c: 128/128 at 32 | 600.0 | 660.0 | 500.0 | 1.20x | 1.32x |"
