"""Does a block right after a gpulens block run slower? A check of the interleaved A/A design
over every ``paths_aa.py`` result kept (issue 18).

``paths_aa.py --mode interleaved`` stops gpulens's monitor at the first (burn-in) step of the
block after a gpulens block; if that stop (or anything else of gpulens) spilled into the next
block's counted steps, the arm that happened to follow gpulens more often would look slower,
and the A/A arm would show biases. Per result file and path, an ordinary least-squares fit of
each block's value (pp of its round's baseline block) on: a fixed effect per round, one per arm
(the baseline the reference), ``prevG`` (the block before it, in the same round or the last of
the previous round, ran gpulens) and one per position in the round. Printed: the ``prevG``,
arm and position coefficients with 1.96 standard errors.

    python benchmarks/carryover.py benchmarks/results/2026-11-2*-h*/paths_aa*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def blocks(path: Path) -> dict[str, list[tuple[int, int, str, str | None, float]]]:
    """Per path name: (round, position, arm, previous block's arm, ms) of every block."""
    data = json.loads(path.read_text())
    out: dict[str, list[tuple[int, int, str, str | None, float]]] = {}
    for name, p in data.get("paths", {}).items():
        prev: str | None = None
        for rnd, order in enumerate(p.get("orders") or []):
            for pos, arm in enumerate(order):
                value = p["arms"].get(arm, {}).get("per_round_ms", {}).get(str(rnd))
                if value is not None:
                    out.setdefault(name, []).append((rnd, pos, arm, prev, float(value)))
                prev = arm
    return out


def fit(name: str, rows: list[tuple[int, int, str, str | None, float]]) -> dict[str, Any]:
    base = {r: v for r, _, arm, _, v in rows if arm == name}
    data = [(r, k, a, p, 100.0 * (v - base[r]) / base[r]) for r, k, a, p, v in rows if r in base]
    rounds = sorted({d[0] for d in data})
    arms = sorted({d[2] for d in data} - {name})
    positions = range(1, max(d[1] for d in data) + 1)
    cols = ([("round", r) for r in rounds] + [("arm", a) for a in arms] + [("prevG", "")]
            + [("pos", k) for k in positions])
    idx = {c: i for i, c in enumerate(cols)}
    x = np.zeros((len(data), len(cols)))
    y = np.zeros(len(data))
    for i, (r, k, a, prev, val) in enumerate(data):
        x[i, idx[("round", r)]] = 1
        if a != name:
            x[i, idx[("arm", a)]] = 1
        if prev is not None and prev.endswith("gpulens"):
            x[i, idx[("prevG", "")]] = 1
        if k > 0:
            x[i, idx[("pos", k)]] = 1
        y[i] = val
    beta, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    s2 = float(resid @ resid) / max(1, len(y) - rank)
    cov = s2 * np.linalg.pinv(x.T @ x)
    return {"blocks": len(y), "resid_sd_pp": s2 ** 0.5,
            "coef": {f"{c[0]} {c[1]}".strip(): (float(beta[i]), 1.96 * float(cov[i, i]) ** 0.5)
                     for c, i in idx.items() if c[0] != "round"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    print("| run | path | blocks | prevG (pp) | gpulens arm (pp) | A/A arm (pp) |")
    print("|---|---|---|---|---|---|")
    prev_g = []
    for path in sorted(args.files):
        for name, rows in blocks(path).items():
            res = fit(name, rows)
            c = res["coef"]
            g, aa = c.get(f"arm {name}_gpulens"), c.get(f"arm {name}_b")
            prev_g.append(c["prevG"][0])

            def fmt(v: tuple[float, float] | None) -> str:
                return "-" if v is None else f"{v[0]:+.2f} +- {v[1]:.2f}"

            print(f"| {path.parent.name} | {name} | {res['blocks']} | {fmt(c['prevG'])} | "
                  f"{fmt(g)} | {fmt(aa)} |")
    if prev_g:
        print(f"\nprevG over {len(prev_g)} fits: {min(prev_g):+.2f} to {max(prev_g):+.2f} pp, "
              f"{sum(v > 0 for v in prev_g)} above zero")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
