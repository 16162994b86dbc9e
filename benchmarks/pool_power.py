"""How many runs does a +-0.3 pp claim need, when runs differ? A simulation of the pools'
judgement (issue 18).

``paths_pool.py`` judges the bound on the runs set side by side (``paired.between_runs``:
DerSimonian-Laird weights, Hartung-Knapp's Student-t interval, never narrower than the pooled
rounds'). This script draws pools the way the device runs make them: ``k`` runs of ``n`` rounds;
each run's own effect is the true mean plus a run-level offset (SD ``--tau``); each round adds
per-round noise (SD ``--sd``). For each ``k`` it reports, over ``--trials`` pools:

* **coverage**: how often each interval holds the true mean (95 % is right): the pooled
  rounds' interval (``mean +- 1.96 sd / sqrt(k n)``, what a single pool of rounds says), the
  DerSimonian-Laird normal interval, and the judged one;
* **resolved**: how often the judged interval holds 0 and lies within +-``--bound`` (the claim
  "within +-0.3 pp"); with ``--mean`` 0 that is the chance a pool of that size can make the
  claim at all, with the mean measured so far the chance it will.

Defaults from the twelfth session's runs on four H200s (``results/2026-11-28-h200x4-hf-ls1-
seeds``): per-round SD 1.2 pp, between-run SD 0.25 pp, 28 rounds a run, gpulens at +0.07.

    python benchmarks/pool_power.py                     # the table for k = 2, 4, 8, 12, 16, 24
    python benchmarks/pool_power.py --tau 0 --mean 0    # runs that do not differ

Standard library only; seeded (``--seed``), so a table is repeatable.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired


def draw_pool(rng: random.Random, k: int, n: int, mean: float, tau: float,
              sd: float) -> list[list[float]]:
    """``k`` runs of ``n`` per-round differences (pp)."""
    runs = []
    for _ in range(k):
        level = mean + rng.gauss(0.0, tau)
        runs.append([level + rng.gauss(0.0, sd) for _ in range(n)])
    return runs


def judge(runs: list[list[float]], bound: float) -> dict[str, tuple[float, float] | bool]:
    """The three intervals of one pool, and whether the judged one resolves the bound."""
    flat = [x for r in runs for x in r]
    m = statistics.fmean(flat)
    half = paired.Z95 * statistics.stdev(flat) / math.sqrt(len(flat))
    rounds = paired.Estimate(m, m - half, m + half, min(flat), max(flat),
                             statistics.stdev(flat), len(flat))
    j = paired.judge_runs(runs, rounds, bound)
    b = j.between
    if b is None:
        raise ValueError("a pool needs two runs of two rounds at least")
    # DerSimonian-Laird's normal interval, for comparison (what the pools first used)
    return {"rounds": (rounds.lo, rounds.hi),
            "dl": (b.mean - b.normal_half, b.mean + b.normal_half),
            "judged": (j.interval.lo, j.interval.hi), "resolved": j.within}


def simulate(ks: list[int], n: int, mean: float, tau: float, sd: float, bound: float,
             trials: int, seed: int) -> list[dict[str, float]]:
    rows = []
    for k in ks:
        rng = random.Random(f"pool-power:{seed}:{k}")
        hits = {"rounds": 0, "dl": 0, "judged": 0}
        resolved = 0
        widths = []
        for _ in range(trials):
            res = judge(draw_pool(rng, k, n, mean, tau, sd), bound)
            for name in hits:
                lo, hi = res[name]  # type: ignore[misc]
                hits[name] += lo <= mean <= hi
            lo, hi = res["judged"]  # type: ignore[misc]
            widths.append((hi - lo) / 2)
            resolved += bool(res["resolved"])
        rows.append({"k": k, "rounds": k * n, "cover_rounds": hits["rounds"] / trials,
                     "cover_dl": hits["dl"] / trials, "cover_judged": hits["judged"] / trials,
                     "half_width": statistics.median(widths), "resolved": resolved / trials})
    return rows


def markdown(rows: list[dict[str, float]], args: argparse.Namespace) -> str:
    lines = [f"pools of k runs x {args.rounds} rounds; per-round SD {args.sd} pp, between-run SD "
             f"{args.tau} pp, true mean {args.mean:+} pp; {args.trials} pools each (seed "
             f"{args.seed})", "",
             "| runs | rounds | holds the true mean: rounds' interval | DerSimonian-Laird | "
             f"judged | judged half-width (median, pp) | resolves +-{args.bound:g} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['rounds']} | {100 * r['cover_rounds']:.0f} % | "
                     f"{100 * r['cover_dl']:.0f} % | {100 * r['cover_judged']:.0f} % | "
                     f"{r['half_width']:.2f} | {100 * r['resolved']:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--runs", default="2,4,8,12,16,24", help="k, comma-separated")
    p.add_argument("--rounds", type=int, default=28, help="rounds a run")
    p.add_argument("--sd", type=float, default=1.2, help="per-round SD, pp")
    p.add_argument("--tau", type=float, default=0.25, help="between-run SD, pp")
    p.add_argument("--mean", type=float, default=0.07, help="the true difference, pp")
    p.add_argument("--bound", type=float, default=0.3)
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ks = [int(x) for x in args.runs.split(",") if x.strip()]
    if any(k < 2 for k in ks) or args.rounds < 2:
        p.error("a pool needs at least two runs of two rounds")
    rows = simulate(ks, args.rounds, args.mean, args.tau, args.sd, args.bound, args.trials,
                    args.seed)
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
