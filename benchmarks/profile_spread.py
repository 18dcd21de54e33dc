"""How much served profiles disagree: several profiles' prices of the same real steps.

Each ``sim_fidelity`` run saves its served profile (``results/sim_fidelity_profile.json``)
and the replica's own log of every step of its runs (``results/sim_fidelity_steps.json``);
earlier runs' files are in git history. This prices every logged decode and mixed step of
every run given with every profile given, and prints, per run and load, the priced /
measured ratio of each (1.0: that profile priced those steps at their measured time).
Along a row the run is fixed, so the spread of a row is the profiles' own, whatever the
machine did during the run.

    git show REV:benchmarks/results/sim_fidelity_profile.json > p1.json  # for each run
    git show REV:benchmarks/results/sim_fidelity_steps.json > s1.json
    .venv/bin/python -m benchmarks.profile_spread --profiles p1.json p2.json ...
        --steps s1.json s2.json ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sendpath.sim.calibrated import Calibrated
from sendpath.sim.profile import step_kind, step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, nargs="+", required=True)
    parser.add_argument("--steps", type=Path, nargs="+", required=True)
    parser.add_argument("--kinds", default="decode,mixed")
    args = parser.parse_args()
    models = [Calibrated.load(p) for p in args.profiles]
    print("| run | load | kind | steps | " + " | ".join(p.stem for p in args.profiles) +
          " | spread |")  # fmt: skip
    print("|---|---|---|---:|" + "---:|" * (len(models) + 1))
    spreads: dict[str, list[float]] = {}
    for path in args.steps:
        log = json.loads(path.read_text())
        keys = log.pop("keys")[0]
        for load, rows in log.items():
            timed = step_times([dict(zip(keys, row, strict=True)) for row in rows])
            for kind in args.kinds.split(","):
                mine = [(shape, s) for shape, s in timed if step_kind(shape).value == kind]
                if not mine:
                    continue
                took = sum(s for _, s in mine)
                ratios = [sum(m.step_seconds(shape) for shape, _ in mine) / took for m in models]
                spread = max(ratios) - min(ratios)
                spreads.setdefault(kind, []).append(spread)
                print(f"| {path.stem} | {load} | {kind} | {len(mine)} | "
                      + " | ".join(f"{r:.3f}" for r in ratios) + f" | {spread:.3f} |")  # fmt: skip
    for kind, found in spreads.items():
        middle, most = statistics.median(found), max(found)
        print(f"{kind}: the profiles' prices of the same steps spread {middle:.3f} "
              f"(median over the rows), {most:.3f} at most")  # fmt: skip


if __name__ == "__main__":
    main()
