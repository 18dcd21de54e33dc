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
    assert "unknown server vllm: the servers are sendpath, llama.cpp, vLLM-CPU" in done.stderr
