"""Where a paired round's noise comes from, in the kept ``paths_aa.py`` results (issue 18).

A round's difference (an arm's block minus the baseline's, one round) is what the pools
average. If the steps of a block were independent, its SD would be ``sqrt(2) * s / sqrt(n)``
(``s`` the SD of a step within a block, ``n`` the block's measured steps); what is left beyond
that is a part that moves whole blocks (the GPU's clocks, the neighbours on the host, ...),
which more steps a block do not average away and only more blocks do. Per result file, path and
arm (rank 0's steps, ``steps_rank0``):

``s``        the SD of a step within its block, ms (pooled over blocks; the last step left
             out: see ``last``);
``ac1``      the steps' lag-1 autocorrelation within a block (mean over blocks; the last
             step left out);
``pred``     the paired difference's SD if steps were independent (each arm with its own
             spread, the last step with its own), ms;
``obs``      the paired difference's SD over the rounds, ms (the baseline: its A/A arm's);
``block``    the SD of the part that moves a whole block (or wanders inside it: ``ac1``),
             ms: ``sqrt((obs^2 - pred^2) / 2)``;
``last``     the last measured step's excess over the mean of its block's other steps, ms
             (mean and SD over blocks: work at a block's end counted in its last step).

    python benchmarks/block_noise.py benchmarks/results/2026-11-28-h200x4-*/*/paths_aa.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def lag1(xs: list[float]) -> float:
    """Lag-1 autocorrelation of ``xs`` (NaN for fewer than 3 or no spread)."""
    if len(xs) < 3:
        return math.nan
    m = statistics.fmean(xs)
    var = sum((x - m) ** 2 for x in xs)
    if var == 0:
        return math.nan
    return sum((xs[i] - m) * (xs[i + 1] - m) for i in range(len(xs) - 1)) / var


def _blocks(steps: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Each round's counted steps (ms), blocks of three or more."""
    return {r: [float(v) for v in rec["ms"]] for r, rec in steps.items() if len(rec["ms"]) > 2}


def _own(blocks: dict[str, list[float]]) -> dict[str, float]:
    """One arm's own figures: steps a block, ``s`` (the last step left out), the last step's
    excess and its SD, ``ac1`` (the last step left out), and the variance of a block's mean
    were its steps independent (the last with its own spread), ms squared."""
    n = statistics.fmean(len(ms) for ms in blocks.values())
    s = math.sqrt(statistics.fmean(statistics.variance(ms[:-1]) for ms in blocks.values()))
    last = [ms[-1] - statistics.fmean(ms[:-1]) for ms in blocks.values()]
    last_sd = statistics.stdev(last)
    return {"steps": n, "s_ms": s, "last_ms": statistics.fmean(last), "last_sd_ms": last_sd,
            "ac1": statistics.fmean(lag1(ms[:-1]) for ms in blocks.values()),
            "var_mean": ((n - 1) * s * s + last_sd * last_sd) / (n * n)}


def arm_noise(steps: dict[str, dict[str, Any]], against: dict[str, dict[str, Any]]
              ) -> dict[str, float]:
    """One arm's figures (module doc) from its blocks' steps and those of the arm it is set
    against (the baseline; for the baseline, its A/A arm), by round: ``pred`` from both arms'
    own spreads."""
    mine, theirs = _blocks(steps), _blocks(against)
    own, other = _own(mine), _own(theirs)
    pred = math.sqrt(own["var_mean"] + other["var_mean"])
    diffs = [statistics.fmean(ms) - statistics.fmean(theirs[r]) for r, ms in mine.items()
             if r in theirs]
    obs = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
    return {"blocks": len(mine), "steps": own["steps"], "s_ms": own["s_ms"], "ac1": own["ac1"],
            "pred_ms": pred, "obs_ms": obs,
            "block_ms": math.sqrt(max(0.0, obs * obs - pred * pred) / 2.0),
            "last_ms": own["last_ms"], "last_sd_ms": own["last_sd_ms"]}


def file_noise(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per path name and arm, :func:`arm_noise`; the baseline is set against its A/A arm."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, p in json.loads(path.read_text()).get("paths", {}).items():
        steps = p.get("steps_rank0") or {}
        if name not in steps:
            continue
        aa = steps.get(f"{name}_b")
        for arm, by_round in steps.items():
            against = steps[name] if arm != name else aa
            if against:
                out.setdefault(name, {})[arm] = arm_noise(by_round, against)
    return out


def markdown(results: dict[str, dict[str, dict[str, dict[str, float]]]]) -> str:
    lines = ["| file | path | arm | blocks x steps | s ms | ac1 | pred ms | obs ms | block ms "
             "| last ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, by_path in results.items():
        for name, by_arm in by_path.items():
            for arm, f in by_arm.items():
                tag = arm[len(name):].lstrip("_") or "base"
                lines.append(
                    f"| {label} | {name} | {tag} | {f['blocks']} x {f['steps']:.0f} | "
                    f"{f['s_ms']:.2f} | {f['ac1']:+.2f} | {f['pred_ms']:.2f} | {f['obs_ms']:.2f} "
                    f"| {f['block_ms']:.2f} | {f['last_ms']:+.1f} +- {f['last_sd_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="paths_aa.json files")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    results = {f"{f.parent.parent.name}/{f.parent.name}": file_noise(f) for f in args.files}
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
