"""Each round's difference to the baseline (pp), grouped by the run's last train() call against
its others, gpulens and the A/A arm; mean and an approximate 95 % interval (t, n - 1).

    python3 by_call.py c*/g0/r*/paths_aa.json > by_call.md      # from this folder
"""

from __future__ import annotations

import json
import math
import statistics
import sys

T95 = {11: 2.201, 59: 2.001}


def main(paths: list[str]) -> None:
    groups: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        with open(path) as f:
            p = json.load(f)["paths"]["hf_ls1"]
        arms, calls = p["arms"], p["train_call"]
        base = arms["hf_ls1"]["per_round_ms"]
        last = max(calls.values())
        for r, b in base.items():
            where = "last call" if calls[r] == last else "other calls"
            for arm in ("hf_ls1_gpulens", "hf_ls1_b"):
                x = arms[arm]["per_round_ms"][r]
                groups.setdefault((arm, where), []).append(100.0 * (x - b) / b)
    print("| arm | rounds of | n | mean (pp) | ~95 % interval (pp) |\n|---|---|---|---|---|")
    for (arm, where), xs in sorted(groups.items()):
        m = statistics.mean(xs)
        half = T95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / math.sqrt(len(xs))
        print(f"| {arm} | {where} | {len(xs)} | {m:+.2f} | [{m - half:+.2f}, {m + half:+.2f}] |")


if __name__ == "__main__":
    main(sys.argv[1:])
