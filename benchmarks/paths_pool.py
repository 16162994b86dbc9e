"""Pool the rounds of several ``paths_aa.py`` runs of one path into one comparison (issue 18).

A device call lasts at most ten minutes; a path whose A/A noise asks for more rounds than one
call holds runs in several calls, each a training run of its own. Each round is paired inside
itself (every arm ran in it, in a shuffled order), so rounds from different calls pool: each
round keeps its own per-round difference, and the pooled mean, 95 % interval and verdict are
``paired.py``'s over all of them. What makes pooling honest is deciding the calls before
seeing any of them (the number of calls is set in advance, not until a result looks good), and
pooling only runs of the same path, model, batch and kind of GPU: this script refuses runs
that differ in any of these, and runs that share an order seed (the same sequence of orders:
``paired.py``, "Seeds"; ``--same-orders`` pools them anyway and says so). It prints each run's
own figures beside the pooled ones; the runs set side by side (``paired.between_runs``:
Cochran's Q, I squared, the between-run SD) with the random-effects interval, on which the
bound is judged, or on the pooled rounds' where that is wider (the rounds of one run are not
independent of each other the way runs are);
each arm's step by position in its blocks, the runs as units (a start or stop that reaches
past the burn-in shows at the first or last counted positions, which no run alone resolves);
and, where the runs have variant arms (``paths_aa.py --variants``), the gpulens arm minus each,
paired per round.

    python benchmarks/paths_pool.py results/X/paths_aa.json results/Y/paths_aa.json \\
        --path hf_ls1 --md pooled.md --json pooled.json

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired

ROUND_STRIDE = 100_000
"""A pooled round's key: ``run index * ROUND_STRIDE + round`` (a run has far fewer rounds)."""


def identity(doc: dict[str, Any]) -> dict[str, Any]:
    """What must be the same for two runs' rounds to pool."""
    meta = doc["meta"]
    hw = meta.get("hardware", {})
    model = meta.get("model", {})
    args = meta.get("args", {})
    return {"gpu": hw.get("gpu", hw.get("device")), "world_size": meta.get("world_size"),
            "n_params": model.get("n_params"), "batch": model.get("batch"),
            "seq_len": model.get("seq_len"), "mode": args.get("mode"),
            "measured_steps": args.get("measured_steps"), "burn_steps": args.get("burn_steps"),
            "interval": args.get("interval")}


def seed_of(doc: dict[str, Any]) -> int:
    """A run's order seed (runs before seeds were drawn afresh had 0; two such runs, or one
    beside a new run of seed 0, count as sharing it: the cautious side)."""
    seed = doc["meta"].get("args", {}).get("seed")
    return 0 if seed is None else int(seed)


def per_run_pp(docs: list[dict[str, Any]], name: str, arm: str,
               unit: str = "run") -> list[list[float]]:
    """Each run's per-round differences of ``arm`` to the baseline ``name`` (pp); with
    ``unit="call"`` each training-run call's (``paths_aa.py``'s ``train_call``; a run that
    does not record it is one unit)."""
    out: list[list[float]] = []
    for doc in docs:
        one = pool([doc], name)
        if arm not in one or name not in one:
            continue
        diffs = paired.per_round_pp(one[arm], one[name])
        calls = doc["paths"][name].get("train_call") or {}
        if unit == "call" and calls:
            by_call: dict[int, list[float]] = {}
            for rnd, d in diffs.items():
                by_call.setdefault(int(calls.get(str(rnd), calls.get(rnd, -1))), []).append(d)
            out.extend(by_call[c] for c in sorted(by_call))
        else:
            out.append(list(diffs.values()))
    return out


def between_table(docs: list[dict[str, Any]], name: str, bound: float,
                  rounds: dict[str, paired.Estimate], unit: str = "run"
                  ) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and JSON of the runs (``unit="call"``: each run's training-run calls)
    set side by side, per arm; ``rounds``: each arm's pooled-rounds estimate (the judged
    interval is never narrower)."""
    lines = [("each training-run call counted as a run (--unit call; a process's calls may "
              "share its state: an exploration, not the judgement of record)\n\n"
              if unit == "call" else "") +
             "runs side by side (a run's rounds share its state): Q about runs - 1 and I "
             "squared 0 where the runs agree; the random-effects interval (Hartung-Knapp) "
             "widens where they disagree and where they are few; the bound is judged on it, "
             "or on the pooled rounds' interval where that is wider", "",
             "| arm | runs | Q | I squared | between-run SD (pp) | random effects (pp): mean "
             f"[95 % CI] | judged interval (pp) | within +-{bound:g} pp? |",
             "|---|---|---|---|---|---|---|---|"]
    out: dict[str, Any] = {}
    notes: list[str] = []
    for arm in (paired.aa_name(name), f"{name}_gpulens"):
        if arm not in rounds:
            continue
        j = paired.judge_runs(per_run_pp(docs, name, arm, unit), rounds[arm], bound)
        b = j.between
        if b is None:
            continue
        if j.left_out:
            notes.append(f"{arm}: {j.left_out} run(s) of fewer than 2 rounds left out of the "
                         "runs side by side (their rounds are in the pooled ones)")
        re_est = paired.Estimate(b.mean, b.lo, b.hi, math.nan, math.nan, math.nan, b.runs)
        lines.append(f"| {arm} | {b.runs} | {b.q:.2f} | {100 * b.i2:.0f} % | {b.tau:.3f} | "
                     f"{paired.fmt_est(re_est)} | [{paired.fmt_pp(j.interval.lo)}, "
                     f"{paired.fmt_pp(j.interval.hi)}] | {j.verdict} |")
        out[arm] = {**b.as_dict(), "judged_ci95_pp": [j.interval.lo, j.interval.hi],
                    "within_bound": j.verdict}
    return ([*lines, *(["", *notes] if notes else [])] if out else []), out


def by_position(docs: list[dict[str, Any]], name: str, burn: int
                ) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines and JSON of each arm's step minus the baseline's at each position of a
    block (rank 0's ``profile_ms_rank0``), the runs as units: mean and 95 % t interval over
    the runs that recorded it. Where a monitor's start or stop reaches past the ``burn``
    burn-in steps into the counted ones, the first or last counted positions show it, which
    no run alone resolves. Also, per arm, the first counted step minus the mean of the other
    counted steps (the part of a start that leaks into the block's value), in ms and as pp of
    the block's value (that excess over the counted steps, of the baseline's step)."""
    arms = [paired.aa_name(name), f"{name}_gpulens"]
    diffs: dict[str, list[list[float]]] = {a: [] for a in arms}
    base_ms: list[float] = []
    for doc in docs:
        prof = doc["paths"].get(name, {}).get("profile_ms_rank0") or {}
        base = prof.get(name)
        if not base:
            continue
        base_ms.append(statistics.fmean(base[burn:]) if len(base) > burn else math.nan)
        for arm in arms:
            steps = prof.get(arm)
            if steps and len(steps) == len(base):
                diffs[arm].append([a - b for a, b in zip(steps, base, strict=True)])
    arms = [a for a in arms if len(diffs[a]) >= 2]
    if not arms:
        return [], {}

    def est(values: list[float]) -> tuple[float, float, float]:
        n = len(values)
        m = statistics.fmean(values)
        h = paired.t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
        return m, m - h, m + h

    positions = min(len(d) for a in arms for d in diffs[a])
    lines = ["each arm's step minus the baseline's at each position of its blocks (ms, rank 0), "
             "the runs as units: mean [95 % t interval]; a position whose interval excludes 0 "
             "is marked *", "",
             "| position | part | " + " | ".join(f"{a} (runs: {len(diffs[a])})" for a in arms)
             + " |", "|---|---|" + "---|" * len(arms)]
    out: dict[str, Any] = {"burn_steps": burn, "arms": {}}
    for arm in arms:
        out["arms"][arm] = {"runs": len(diffs[arm]), "positions": []}
    for i in range(positions):
        cells = []
        for arm in arms:
            m, lo, hi = est([d[i] for d in diffs[arm]])
            mark = " *" if lo > 0 or hi < 0 else ""
            cells.append(f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}]{mark}")
            out["arms"][arm]["positions"].append({"mean_ms": m, "ci95_ms": [lo, hi]})
        part = "burn-in" if i < burn else "counted"
        lines.append(f"| {i} | {part} | " + " | ".join(cells) + " |")
    counted = positions - burn
    finite = [b for b in base_ms if math.isfinite(b)]
    step_ms = statistics.fmean(finite) if finite else math.nan
    if counted >= 2:
        lines += ["", "the first counted step minus the mean of the other counted steps, "
                  "per run, the runs as units (ms; pp: its share of the block's value)", "",
                  "| arm | runs | ms: mean [95 % CI] | pp of a step |", "|---|---|---|---|"]
        for arm in arms:
            firsts = [d[burn] - statistics.fmean(d[burn + 1:positions]) for d in diffs[arm]]
            m, lo, hi = est(firsts)
            pp = 100.0 * m / counted / step_ms if step_ms and math.isfinite(step_ms) else math.nan
            lines.append(f"| {arm} | {len(firsts)} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                         f"{pp:+.3f} |")
            out["arms"][arm]["first_counted_excess"] = {"mean_ms": m, "ci95_ms": [lo, hi],
                                                       "pp": pp}
    return lines, out


def pool(docs: list[dict[str, Any]], name: str) -> dict[str, dict[int, float]]:
    """arm -> pooled round key -> seconds per step, over every run that has path ``name``."""
    values: dict[str, dict[int, float]] = {}
    for i, doc in enumerate(docs):
        run = doc["paths"].get(name)
        if run is None:
            continue
        for arm, figures in run["arms"].items():
            into = values.setdefault(arm, {})
            for rnd, ms in figures["per_round_ms"].items():
                into[i * ROUND_STRIDE + int(rnd)] = ms / 1e3
    return values


def aa_sd(values: dict[str, dict[int, float]], name: str) -> float:
    """The larger per-round SD (pp) of the A/A arm's and the gpulens arm's differences."""
    sds = []
    for arm in (paired.aa_name(name), f"{name}_gpulens"):
        if arm in values and name in values:
            s = paired.sd(list(paired.per_round_pp(values[arm], values[name]).values()))
            if math.isfinite(s):
                sds.append(s)
    return max(sds) if sds else math.nan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="paths_aa.json files")
    p.add_argument("--path", required=True, help="the path to pool, e.g. hf_ls1")
    p.add_argument("--bound-pp", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unit", choices=("run", "call"), default="run",
                   help="what is set side by side: each run (a paths_aa.py process; the "
                   "default) or each of its training-run calls (train_call)")
    p.add_argument("--same-orders", action="store_true",
                   help="pool runs that share an order seed (said in the report)")
    p.add_argument("--md", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    docs = [json.loads(f.read_text()) for f in args.runs]
    have = [(f, d) for f, d in zip(args.runs, docs, strict=True) if args.path in d["paths"]]
    if not have:
        print(f"paths_pool.py: no run has path {args.path!r}", file=sys.stderr)
        return 2
    ids = [identity(d) for _, d in have]
    differ = sorted({k for i in ids for k in i if i[k] != ids[0][k]})
    if differ:
        print(f"paths_pool.py: the runs differ in {', '.join(differ)}; not pooled:",
              file=sys.stderr)
        for (f, _), i in zip(have, ids, strict=True):
            print(f"  {f}: " + ", ".join(f"{k}={i[k]}" for k in differ), file=sys.stderr)
        return 2
    seeds = [seed_of(d) for _, d in have]
    shared = paired.shared_seeds([(s,) for s in seeds])
    if shared and not args.same_orders:
        print(f"paths_pool.py: {paired.shared_seeds_refused(shared)}", file=sys.stderr)
        return 2
    values = pool([d for _, d in have], args.path)
    arms = list(values)
    comps = paired.compare(values, dict.fromkeys(arms, args.path), seed=args.seed)
    sd = aa_sd(values, args.path)
    rounds = len(values.get(args.path, {}))
    plan = paired.Plan(0, sd, paired.rounds_needed(sd, args.bound_pp), None, rounds, sd,
                       args.bound_pp)
    lines = [f"## {args.path}: {rounds} rounds pooled from {len(have)} runs",
             "", "identity: " + json.dumps(ids[0]), "",
             "| run | date | commit | rounds | its A/A SD (pp) | gpulens - baseline (pp) |",
             "|---|---|---|---|---|---|"]
    per_run = []
    for f, d in have:
        one = pool([d], args.path)
        c = {x.arm: x for x in paired.compare(one, dict.fromkeys(one, args.path),
                                              seed=args.seed)}
        g = c.get(f"{args.path}_gpulens")
        n = len(one.get(args.path, {}))
        s = aa_sd(one, args.path)
        lines.append(f"| {f} | {d['meta'].get('date')} | {d['meta'].get('commit')} | {n} | "
                     f"{s:.3f} | {paired.fmt_est(g.est) if g else '-'} |")
        per_run.append({"file": str(f), "date": d["meta"].get("date"), "seed": seed_of(d),
                        "commit": d["meta"].get("commit"), "rounds": n, "sd_pp": s,
                        "gpulens": g.as_dict() if g else None})
    between_lines, between = between_table([d for _, d in have], args.path, args.bound_pp,
                                           {c.arm: c.est for c in comps}, args.unit)
    lines += ["", plan.line().replace("fixed by the command (no pilot)", "pooled"), "",
              paired.table(comps, None if between else args.bound_pp), "",
              *paired.bias_notes(comps)]
    if between_lines:
        lines += ["", *between_lines]
    if shared:
        lines += ["", paired.shared_seeds_pooled(shared)]
    position_lines, positions = by_position([d for _, d in have], args.path,
                                            int(ids[0].get("burn_steps") or 0))
    if position_lines:
        lines += ["", *position_lines]
    variants = {arm: paired.Estimate.of(d, args.seed)
                for arm, d in paired.variants_minus(values, args.path).items()}
    if variants:
        lines += ["", "gpulens minus each variant, paired per round (pp of the baseline's "
                  "step; positive: the variant's setting takes that much away)", "",
                  "| variant | rounds | total (pp): mean [95 % CI] |", "|---|---|---|"]
        lines += [f"| {arm} | {est.n} | {paired.fmt_est(est)} |"
                  for arm, est in variants.items()]
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({
            "path": args.path, "identity": ids[0], "runs": per_run, "plan": plan.as_dict(),
            "seeds": seeds, "same_orders": bool(shared), "between_runs": between,
            "unit": args.unit, "by_position": positions,
            "comparisons": [
                {**c.as_dict(),
                 "within_bound": (between[c.arm]["within_bound"] if c.arm in between
                                  else paired.equivalence(c.est, args.bound_pp)),
                 "judged_on": "runs side by side" if c.arm in between else "rounds"}
                for c in comps],
            "variants_vs_gpulens": {a: e.as_dict() for a, e in variants.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
