"""The gpulens arm's counted steps over its median + 5 ms, with their block position and split.

Usage (from this folder): python3 slow_steps.py c*/g0/r*/paths_aa.json > slow_steps.md
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter


def main(paths: list[str]) -> None:
    positions: Counter[int] = Counter()
    print("| run | round | counted position | over median (ms) | gap (ms) | busy (ms) | "
          "training-thread CPU (ms) |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            steps = json.load(f)["paths"]["hf_ls1"]["steps_rank0"]["hf_ls1_gpulens"]
        median = statistics.median(ms for r in steps.values() for ms in r["ms"])
        for rnd, v in steps.items():
            for i, ms in enumerate(v["ms"]):
                if ms > median + 5:
                    positions[i] += 1
                    print(f"| {path} | {rnd} | {i} | {ms - median:+.1f} | {v['gap_ms'][i]:.2f} | "
                          f"{v['busy_ms'][i]:.1f} | {v['cpu_ms'][i]:.1f} |")
    print()
    print("by counted position:", dict(sorted(positions.items())))


if __name__ == "__main__":
    main(sys.argv[1:])
