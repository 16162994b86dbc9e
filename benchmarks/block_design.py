"""How long should a block be? Read from a ``paths_aa.py`` run's own per-step record (issue 18).

A round's difference between two arms is the difference of two blocks' means, ``burn`` steps
apart; its spread is what sets the rounds a claim needs. If steps were independent, longer
blocks would pay for themselves; where the step time wanders in runs of many steps (the HF
path on an H200: ``results/2026-11-27-h200-hf-ls1-steps``), a short block is nearly as good as
a long one and costs less time. This script measures which, from a run's counted steps (every
arm's, less that arm's mean, in the order they ran):

* for each block length ``B`` that fits twice into one counted block with ``burn`` steps
  between (``2 B + burn <= measured``), the SD of ``mean(next B) - mean(B)`` over every such
  pair of windows inside a block;
* for the run's own design (``B = measured``), the same over consecutive blocks;
* each design's device time for the same precision, relative to the run's own: rounds scale
  with the SD squared, a round's time with ``B + burn``.

    python benchmarks/block_design.py results/X/paths_aa.json --path hf_ls1

Standard library only. A guide for planning the next run, not a result: the windows of one
block share its arm and its start-up, and their gaps are real steps, not a start and a stop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


def blocks(doc: dict[str, Any], name: str) -> list[list[float]]:
    """Each counted block's steps (ms) less its arm's mean, in the order the blocks ran."""
    steps = doc["paths"][name]["steps_rank0"]
    means = {arm: statistics.fmean(v for rec in rounds.values() for v in rec["ms"])
             for arm, rounds in steps.items() if rounds}
    out = [(rec["span"][0], [v - means[arm] for v in rec["ms"]])
           for arm, rounds in steps.items() for rec in rounds.values() if rec["ms"]]
    return [b for _, b in sorted(out, key=lambda x: x[0])]


def spread(runs: list[list[float]], size: int, burn: int, measured: int) -> tuple[float, int]:
    """(SD of the difference of two windows' means, pairs) for windows of ``size`` steps
    ``burn`` apart: inside blocks, or (``size == measured``) consecutive blocks."""
    diffs: list[float] = []
    if size == measured:
        diffs = [statistics.fmean(b) - statistics.fmean(a) for a, b in itertools.pairwise(runs)
                 if len(a) == len(b) == size]
    else:
        for block in runs:
            for i in range(0, len(block) - 2 * size - burn + 1):
                first = block[i:i + size]
                second = block[i + size + burn:i + 2 * size + burn]
                diffs.append(statistics.fmean(second) - statistics.fmean(first))
    return (statistics.stdev(diffs) if len(diffs) > 1 else math.nan), len(diffs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("run", type=Path, help="a paths_aa.json with steps_rank0")
    p.add_argument("--path", required=True)
    p.add_argument("--burn", type=int, default=None, help="default: the run's --burn-steps")
    args = p.parse_args(argv)
    doc = json.loads(args.run.read_text())
    if args.path not in doc["paths"] or not doc["paths"][args.path].get("steps_rank0"):
        print(f"block_design.py: {args.run} has no per-step record of {args.path!r}",
              file=sys.stderr)
        return 2
    measured = int(doc["meta"]["args"]["measured_steps"])
    burn = args.burn if args.burn is not None else int(doc["meta"]["args"]["burn_steps"])
    runs = blocks(doc, args.path)
    sizes = [b for b in range(2, measured) if 2 * b + burn <= measured] + [measured]
    base_sd, _ = spread(runs, measured, burn, measured)
    per_round = doc["paths"][args.path]["arms"][args.path]["per_round_ms"]
    step_ms = statistics.fmean(per_round.values())
    lines = [f"## {args.path}: block length against the difference's spread ({args.run})", "",
             f"{len(runs)} counted blocks of {measured} steps, burn {burn}; step {step_ms:.1f} "
             f"ms", "", "| B (counted steps) | pairs | SD of the difference (ms) | (pp) | "
             "device time for the same precision (x the run's) |", "|---|---|---|---|---|"]
    for size in sizes:
        sd, n = spread(runs, size, burn, measured)
        rel = (sd / base_sd) ** 2 * (size + burn) / (measured + burn)
        lines.append(f"| {size}{' (the run)' if size == measured else ''} | {n} | {sd:.3f} | "
                     f"{100 * sd / step_ms:.2f} | {rel:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
