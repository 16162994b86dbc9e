"""Pool the rounds of several ``step_work_ab.py`` runs into one comparison per rank (issue 18).

Each round of ``step_work_ab.py`` is paired inside itself (its ``on``, ``off`` and ``off_b``
segments ran in one order in one training run), so rounds of several runs pool as
``paths_pool.py`` pools ``paths_aa.py``'s: each round keeps its own per-round difference and the
pooled mean and 95 % interval are ``paired.py``'s over all of them. Only runs of the same
logging period, batch, segment, world size and GPU model pool (refused otherwise). Each run's
own figures are printed beside the pooled ones, and whether the pooled interval holds zero and
lies within +-``--bar`` pp (issue 18's bar: 0.3), judged on the random-effects interval of the
runs set side by side (``paired.between_runs``: a run's rounds share its state, so runs may
disagree by more than their rounds' spread says), or on the pooled rounds' where that is wider.
Runs that share an order seed ran the same sequence of segment orders (``paired.py``, "Seeds")
and are refused unless ``--same-orders`` (then said). Say which runs were decided before any was
seen: a run added after looking is a choice, and the report lists every run.

    python benchmarks/step_work_pool.py A/swab.json A/swab.rank1.json B/swab.json ... \\
        --md pooled.md --json pooled.json

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired

ROUND_STRIDE = 100_000
"""A pooled round's key: ``run index * ROUND_STRIDE + round``."""


def identity(meta: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree for two runs' rounds to pool."""
    gpu = meta.get("hardware", {}).get("gpu", meta.get("device"))
    return (meta["log_every"], meta["batch"], meta["seq"], meta["segment"], meta["skip"],
            meta["world_size"], gpu, meta.get("host_marks", False),
            meta.get("monitor", "{}"))


def per_round(doc: dict[str, Any], kind: str) -> dict[int, float]:
    """``kind`` minus ``off`` per round, in pp of ``off``."""
    rounds = doc["result"]["per_round_s"]
    return paired.per_round_pp({int(r): v for r, v in rounds[kind].items()},
                               {int(r): v for r, v in rounds["off"].items()})


def shared_seeds(docs: list[tuple[str, dict[str, Any]]]) -> list[int]:
    """Order seeds used by more than one run: one (seed, rank) in two files (a run's ranks
    share its seed, each rank writes a file of its own; runs before seeds were drawn had 0)."""
    return paired.shared_seeds([(int(d["meta"].get("seed") or 0), int(d["meta"]["rank"]))
                                for _, d in docs])


def pool(docs: list[tuple[str, dict[str, Any]]], bar: float,
         same_orders: bool = False) -> dict[str, Any]:
    """Per rank: each run's estimates and the pooled ones (``on`` and the A/A ``off_b``)."""
    idents = {identity(d["meta"]) for _, d in docs}
    if len(idents) != 1:
        raise SystemExit(f"runs that differ do not pool: {sorted(map(str, idents))}")
    shared = shared_seeds(docs)
    if shared and not same_orders:
        raise SystemExit(paired.shared_seeds_refused(shared))
    by_rank: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, doc in docs:
        by_rank.setdefault(int(doc["meta"]["rank"]), []).append((name, doc))
    out: dict[str, Any] = {"bar_pp": bar, "shared_seeds": shared, "ranks": {}}
    for rank, runs in sorted(by_rank.items()):
        entry: dict[str, Any] = {"runs": [], "pooled": {}}
        pooled: dict[str, dict[int, float]] = {"on": {}, "off_b": {}}
        each: dict[str, list[list[float]]] = {kind: [] for kind in pooled}
        for i, (name, doc) in enumerate(runs):
            run: dict[str, Any] = {"file": name}
            for kind in pooled:
                diffs = per_round(doc, kind)
                run[kind] = paired.Estimate.of(diffs).as_dict()
                pooled[kind].update({i * ROUND_STRIDE + r: v for r, v in diffs.items()})
                each[kind].append(list(diffs.values()))
            entry["runs"].append(run)
        for kind, diffs in pooled.items():
            est = paired.Estimate.of(diffs)
            entry["pooled"][kind] = est.as_dict()
            entry["pooled"][kind]["rounds_needed"] = paired.rounds_needed(est.sd, bar)
            j = paired.judge_runs(each[kind], est, bar)
            entry["pooled"][kind]["between_runs"] = j.between.as_dict() if j.between else None
            entry["pooled"][kind]["judged_ci95_pp"] = [j.interval.lo, j.interval.hi]
            entry["pooled"][kind]["within_bar"] = j.within
        out["ranks"][str(rank)] = entry
    return out


def report(res: dict[str, Any]) -> str:
    def fmt(e: dict[str, Any]) -> str:
        lo, hi = e["ci95_pp"]
        return f"{e['mean_pp']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {e['sd_pp']:.2f} | {e['rounds']}"

    lines = [f"# `step_work_ab.py` runs pooled (bar +-{res['bar_pp']} pp)", "",
             "| rank | run | `on` minus `off`, pp, 95 % | SD | rounds | A/A (`off_b`) | SD | "
             "rounds |", "|---|---|---|---|---|---|---|---|"]
    for rank, entry in res["ranks"].items():
        for run in entry["runs"]:
            lines.append(f"| {rank} | `{run['file']}` | {fmt(run['on'])} | {fmt(run['off_b'])} |")
        p = entry["pooled"]
        lines.append(f"| {rank} | **pooled** | **{fmt(p['on'])}** | {fmt(p['off_b'])} |")
    lines += ["", "Runs side by side (Q about runs - 1 and I squared 0 where they agree; the "
              "random-effects interval, Hartung-Knapp, widens where they disagree and where "
              "they are few; the bar is judged on it, or on the pooled rounds' where wider):",
              "", "| rank | segment | runs | Q | I squared | between-run SD | random effects, pp, "
              "95 % | judged interval |", "|---|---|---|---|---|---|---|---|"]
    for rank, entry in res["ranks"].items():
        for kind in ("on", "off_b"):
            b = entry["pooled"][kind]["between_runs"]
            if b:
                lo, hi = b["ci95_pp"]
                jlo, jhi = entry["pooled"][kind]["judged_ci95_pp"]
                lines.append(f"| {rank} | `{kind}` | {b['runs']} | {b['q']:.2f} | "
                             f"{100 * b['i2']:.0f} % | {b['tau_pp']:.3f} | "
                             f"{b['mean_pp']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                             f"[{jlo:+.3f}, {jhi:+.3f}] |")
    if res["shared_seeds"]:
        lines += ["", paired.shared_seeds_pooled(res["shared_seeds"])]
    lines += ["", "Pooled `on` minus `off` within the bar (the judged interval holds zero and "
              "lies inside +-bar): " + ", ".join(
        f"rank {r}: {'yes' if e['pooled']['on']['within_bar'] else 'no'} (rounds a "
        f"{res['bar_pp']} pp difference needs at this SD: {e['pooled']['on']['rounds_needed']})"
        for r, e in res["ranks"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="step_work_ab.py --json files (any rank)")
    p.add_argument("--bar", type=float, default=0.3, help="pp")
    p.add_argument("--same-orders", action="store_true",
                   help="pool runs that share an order seed (said in the report)")
    p.add_argument("--md", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    docs = [(str(path), json.loads(path.read_text())) for path in args.runs]
    res = pool(docs, args.bar, args.same_orders)
    text = report(res)
    print(text)
    if args.md is not None:
        args.md.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
