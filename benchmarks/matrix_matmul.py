"""block_matmul's loops against each other and the machine's matmul roof, by rows a step.

SmolLM2-135M's four products a layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) with random Q4_1 weights in block_matmul's layout, for 1 to 1,024 rows (one
decode to a long prompt chunk): each loop that runs here (the vector loop, AVX-512 VNNI or
AVX2, and where AMX's tiles run, amx-int8 and amx-bf16) timed at its best of several
calls, in GFLOP/s (2 x rows x N x K a product), beside ``peers.py``'s roofs: torch's own
2048x2048 bfloat16 and float32 matmuls on this machine, and its copy bandwidth. It says from how
many rows each AMX design beats the vector loop on every product: what
``kAmxInt8MinRows`` and ``kAmxBf16MinRows`` in ``kernels/block_matmul.h`` should be on
this CPU kind (the int8 design gives the vector loop's bits, the bfloat16 one bfloat16's
precision, so it takes over where it beats both). Where there is no AMX it times the
vector loop alone and says why (the software model of the tiles is for tests, not timed).

    .venv/bin/python -m benchmarks.matrix_matmul          # about a minute

Results: ``benchmarks/results/matrix_matmul.json`` (named by the CPU it ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers import roofs
from sendpath.model.kernels import cpu_kernels
from sendpath.model.quant import cpu_features, cpu_model, matrix_engine

RESULTS = Path(__file__).resolve().parent / "results" / "matrix_matmul.json"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 1024)


def best_seconds(fn: Callable[[], Any], budget_s: float = 0.3) -> float:
    """The fastest of repeated calls, for about ``budget_s`` (at least 3 calls)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    kernel = cpu_kernels()
    if kernel is None:
        raise SystemExit("the CPU kernels could not be built here")
    loops = [kernel.block_loops()[0], *kernel.matrix_loops()]
    torch.manual_seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, k // 32) * 0.02).half().float()
        weights[name] = (kernel.pack_q4(codes, d, -d * 8), n, k)
    table: dict[str, dict[str, dict[str, float]]] = {}  # loop -> product -> rows -> GFLOP/s
    for loop in loops:
        table[loop] = {}
        for name, (packed, n, k) in weights.items():
            table[loop][name] = {}
            for rows in args.rows:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                seconds = best_seconds(partial(kernel.block_matmul, x, *packed, n, loop=loop))
                table[loop][name][str(rows)] = round(2 * rows * n * k / seconds / 1e9, 1)
            print(loop, name, table[loop][name], flush=True)
    vector = loops[0]
    crossover = {}
    for loop in loops[1:]:  # the fewest rows from which it wins on every product
        wins = [
            r
            for r in args.rows
            if all(table[loop][p][str(r)] > table[vector][p][str(r)] for p in SHAPES)
        ]
        crossover[loop] = min(wins) if wins else None
    results = {
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "cpu_features": sorted(k for k, v in cpu_features().items() if v),
            "matrix_engine": matrix_engine(kernel),
        },
        "torch": torch.__version__,
        "roofs": roofs(),
        "matrix_min_rows": kernel.matrix_min_rows(),
        "gflop_per_s": table,
        "beats_the_vector_loop_from_rows": crossover,
    }
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("machine", "roofs")}, indent=1))
    print("beats", vector, "from rows:", crossover or "(no AMX here)")


if __name__ == "__main__":
    main()
