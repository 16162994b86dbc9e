"""The gpulens arm against the A/A arm (hf_ls1_b), and against the mean of both baselines, per
round, pooled over runs.

An exploration after seeing the data: mean +- 2.01 standard errors (t at 47 degrees of
freedom; a little wide for more rounds). Usage: python3 vs_aa_arm.py c*/g0/r*/paths_aa.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    pairs: list[tuple[float, float]] = []
    for path in paths:
        with open(path) as f:
            arms = json.load(f)["paths"]["hf_ls1"]["arms"]
        ours = arms["hf_ls1_gpulens"]["per_round_ms"]
        aa = arms["hf_ls1_b"]["per_round_ms"]
        base = arms["hf_ls1"]["per_round_ms"]
        for rnd, ms in ours.items():
            both = (base[rnd] + aa[rnd]) / 2
            pairs.append((100 * (ms - aa[rnd]) / aa[rnd], 100 * (ms - both) / both))
    for i, name in enumerate(("gpulens - A/A arm", "gpulens - mean of both baselines")):
        xs = [p[i] for p in pairs]
        mean = statistics.mean(xs)
        se = statistics.stdev(xs) / len(xs) ** 0.5
        print(f"{name}: {mean:+.3f} [{mean - 2.01 * se:+.3f}, {mean + 2.01 * se:+.3f}] pp, "
              f"n={len(xs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
