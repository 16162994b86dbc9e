"""Is each user path with gpulens indistinguishable from its A/A arm? Step time on a GPU, in
blocks alternated within one process (issue 18).

For each path (``--paths``): the baseline, its A/A arm (the same code again, ``<path>_b``) and
the baseline with gpulens (``<path>_gpulens``), over one GPT-2-small-sized model (12 layers,
768 wide, 1024 tokens; bf16 weights; fused AdamW; built from a config, no download) warmed
once for the whole process, its batch chosen so that a step takes about ``--target-ms``:

``hf_ls1``, ``hf_ls10``  Hugging Face ``Trainer``, ``report_to=["wandb"]`` (the offline run this
                       script opens once; W&B's default system monitor), ``logging_steps`` 1 or
                       10, token rows with an attention mask; gpulens: ``GPUMonitorCallback``.
``lightning``          ``lightning.pytorch.Trainer``, a CSV logger, ``log_every_n_steps=1``, dict
                       batches with an attention mask; gpulens: its ``GPUMonitorCallback``;
                       ``--lightning-dsm`` adds ``lightning_dsm`` (``DeviceStatsMonitor``).
``wandb_loop``         a plain loop logging the loss to that W&B run every step; gpulens:
                       ``Monitor(sinks=["wandb"])`` and ``mon.log(step)`` every step.

Under ``torchrun`` (one process per GPU, NCCL) only the HF paths run, in DDP; a block's value
is then the slowest rank's.

**The measurement** (``paths.py``). Each step is timed on the GPU's own timeline (CUDA events
recorded at the end of every step; no device sync added), so host work the GPU's queue hides
costs nothing and host work that starves the GPU shows. ``--mode interleaved`` (default): one
training run goes through short blocks of every arm in turn (per round the three arms in a
balanced, seeded order: ``paired.round_order``; ``--burn-steps`` + ``--measured-steps`` steps
each); gpulens runs only in the gpulens arm's blocks, each as if it were a training run of its
own (its monitor, with its engine process, started at the block's first step and stopped at the
next block's first, both in burn-in steps); a block's value is the mean of its measured steps (a
whole number of logging periods, so costs paid on log steps count). The pilot's rounds are one
training run and the rest another, or, with ``--train-rounds R``, one for each R of them (each
round tagged with its call in the JSON, ``train_call``: whether an arm's effect is a state of
the process or of one ``train()``, ``paths_pool.py --unit call``). ``--mode blocks``: one
training run per arm and round (``--warmup`` + ``--steps`` steps) over a fresh copy of the
warmed model, gpulens's monitor started and stopped with its block, outside the timed steps; a
block's value is the median of its steps.

**The statistics** (``paired.py``): per round, each arm's difference to the baseline in
percentage points of the baseline's step; their mean with a 95 % bootstrap interval; the A/A
arm's interval is the run's envelope. The claim sought is "indistinguishable within
+-``--bound-pp`` (0.3 pp)": the gpulens arm's interval contains 0 and lies inside the bound. A
pilot of ``--pilot`` rounds measures the per-round SD (the larger of the A/A arm's and the
gpulens arm's) and sets the rounds that bound asks for (``paired.rounds_needed``); the path's
time budget (``--budget-s``) caps them, and the report says how many were needed and whether the
cap left the bound unresolved. With ``--variants`` (HF paths: gpulens arms with other settings
in the same rounds) a last table gives the default gpulens arm minus each variant, paired per
round: the total in pp, each rank's gap and busy part in ms (``variants_vs_gpulens`` in the
JSON): what a setting takes away.

    python benchmarks/paths_aa.py --paths hf_ls1,hf_ls10 --budget-s 210       # one GPU
    torchrun --nproc-per-node 2 benchmarks/paths_aa.py --paths hf_ls1 --budget-s 230
    python benchmarks/paths_aa.py --quick --paths hf_ls1,lightning,wandb_loop  # CPU smoke run

Writes ``$OUT/paths_aa.json`` (or ``--json``) after every round, so a time limit still leaves
figures; prints Markdown at the end (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # the model, its warm-up, versions, hardware
import paired
import paths

PATHS = ("hf_ls1", "hf_ls10", "lightning", "wandb_loop")
DDP_PATHS = ("hf_ls1", "hf_ls10")


def make_path(name: str, s: og.Setup, tmp: Path, args: argparse.Namespace) -> Any:
    if name.startswith("hf_ls"):
        return paths.HfPath(s, tmp, int(name[len("hf_ls"):]), ["wandb"], args.interval,
                            {variant_arm(name, v): kw for v, kw in args.variants.items()})
    if name == "lightning":
        return paths.LightningPath(s, tmp, 1, args.interval)
    if name == "wandb_loop":
        return paths.WandbLoopPath(s, args.interval)
    raise ValueError(f"unknown path {name!r}; known: {', '.join(PATHS)}")


def variant_arm(name: str, variant: str) -> str:
    """The arm of a ``--variants`` entry, gpulens with other settings: ``hf_ls1_jsonl_gpulens``."""
    return f"{name}_{variant}_gpulens"


def parse_variants(text: str) -> dict[str, dict[str, Any]]:
    """``NAME=JSON;NAME=JSON`` -> {NAME: attributes}: each an extra gpulens arm whose callback
    gets those attributes (and, under ``"monitor"``, settings fields)."""
    out: dict[str, dict[str, Any]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, kw = part.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--variants: {part!r} is not NAME=JSON")
        value = json.loads(kw)
        if not isinstance(value, dict):
            raise SystemExit(f"--variants: {name}'s JSON is not an object")
        out[name] = value
    return out


def arms_of(name: str, dsm: bool = False, variants: Iterable[str] = ()) -> list[str]:
    arms = [name, paired.aa_name(name), f"{name}_gpulens",
            *(variant_arm(name, v) for v in variants)]
    if dsm and name == "lightning":
        arms.append(f"{name}_dsm")  # Lightning's DeviceStatsMonitor, the built-in peer
    return arms


def pilot_sd(values: dict[str, dict[int, float]], name: str) -> float:
    """The larger per-round SD (pp) of the A/A arm's and the gpulens arm's differences."""
    sds = []
    for arm in (paired.aa_name(name), f"{name}_gpulens"):
        d = paired.per_round_pp(values[arm], values[name])
        s = paired.sd(list(d.values()))
        if math.isfinite(s):
            sds.append(s)
    return max(sds) if sds else math.nan


class PathRun:
    """Every round of one path, and how many were run and why."""

    def __init__(self, name: str, dsm: bool = False, variants: Iterable[str] = ()) -> None:
        self.name = name
        self.arms = arms_of(name, dsm, variants)
        self.values: dict[str, dict[int, float]] = {a: {} for a in self.arms}
        self.cpu_ms: dict[str, dict[int, float]] = {a: {} for a in self.arms}
        self.others_ms: dict[str, dict[int, float]] = {a: {} for a in self.arms}
        self.threads_s: list[dict[str, dict[str, float]]] = []
        """Per rank, per arm: other threads' CPU seconds by name over its counted steps."""
        self.thread_steps: list[dict[str, int]] = []
        self.rank_ms: dict[str, dict[int, list[float]]] = {a: {} for a in self.arms}
        self.orders: list[list[str]] = []
        self.train_call: dict[int, int] = {}
        """Round -> which ``train()`` / ``fit()`` call of this process ran it (0: the pilot's;
        interleaved mode): runs side by side can be set per call (``paths_pool.py --unit
        call``)."""
        self.round_s: list[float] = []
        self.plan: paired.Plan | None = None
        self.failed: str | None = None
        self.split_by_rank: list[dict[str, dict[int, tuple[float, float]]]] = []
        """Per rank, arm and round: its steps' mean (gap, busy) in ms (``Clock.split``)."""
        self.steps: dict[str, dict[int, dict[str, list[float]]]] = {a: {} for a in self.arms}
        """Per arm and round, this rank's counted steps (``paths.Schedule.steps``)."""
        self.profile: dict[str, list[tuple[float, int]]] = {}
        """Per arm, per position in its blocks (burn-in included): (sum of the step's mean
        seconds over the training runs, weighted by their rounds; rounds), this rank's."""

    def add_profile(self, profile: dict[str, list[float]], rounds: int) -> None:
        for arm, steps in profile.items():
            acc = self.profile.setdefault(arm, [(0.0, 0)] * len(steps))
            self.profile[arm] = [(t + v * rounds, n + rounds) if math.isfinite(v) else (t, n)
                                 for (t, n), v in zip(acc, steps, strict=True)]

    def profile_ms(self) -> dict[str, list[float]]:
        """Per arm, the mean step (ms) at each position of its blocks."""
        return {arm: [1e3 * t / n if n else math.nan for t, n in steps]
                for arm, steps in self.profile.items()}

    def comparisons(self, seed: int) -> list[paired.Comparison]:
        return paired.compare(self.values, dict.fromkeys(self.arms, self.name), seed=seed)

    def as_dict(self, seed: int, bound: float) -> dict[str, Any]:
        comps = self.comparisons(seed)
        return {
            "arms": {a: {"per_round_ms": {r: v * 1e3 for r, v in self.values[a].items()},
                         "median_ms": (statistics.median(self.values[a].values()) * 1e3
                                       if self.values[a] else None),
                         "train_thread_cpu_ms_per_step": (
                             statistics.median(self.cpu_ms[a].values())
                             if self.cpu_ms[a] else None),
                         "other_threads_cpu_ms_per_step": (
                             statistics.median(self.others_ms[a].values())
                             if self.others_ms[a] else None),
                         "per_rank_ms": self.rank_ms[a],
                         "other_threads_us_per_step_by_rank": [
                             threads_per_step(t, n, a) for t, n in
                             zip(self.threads_s, self.thread_steps, strict=False)]}
                     for a in self.arms},
            "orders": self.orders, "round_s": self.round_s, "train_call": self.train_call,
            "plan": self.plan.as_dict() if self.plan else None, "failed": self.failed,
            "profile_ms_rank0": self.profile_ms(),
            "steps_rank0": self.steps,
            "split_ms_by_rank": self.split_by_rank,
            "variants_vs_gpulens": variants_vs_gpulens(self, seed),
            "comparisons": [{**c.as_dict(), "within_bound": paired.equivalence(c.est, bound)}
                            for c in comps],
        }


def threads_per_step(threads: dict[str, dict[str, float]], steps: dict[str, int],
                     arm: str) -> dict[str, float]:
    """An arm's other threads' CPU by name, in microseconds per counted step."""
    n = steps.get(arm, 0)
    return {name: 1e6 * spent / n for name, spent in sorted(threads.get(arm, {}).items())} \
        if n else {}


def threads_table(run: PathRun) -> list[str]:
    """Per rank: each thread name's CPU per step in every arm (us), busiest first."""
    out: list[str] = []
    for rank, (threads, steps) in enumerate(zip(run.threads_s, run.thread_steps,
                                                strict=False)):
        per = {a: threads_per_step(threads, steps, a) for a in run.arms}
        names = sorted({n for p in per.values() for n in p},
                       key=lambda n: -max(p.get(n, 0.0) for p in per.values()))
        if not names:
            continue
        out += ["", f"other threads' CPU by name, rank {rank} (us/step, over the counted steps)",
                "", "| thread | " + " | ".join(run.arms) + " |",
                "|---|" + "---|" * len(run.arms)]
        for name in names:
            cells = " | ".join(f"{per[a][name]:.0f}" if name in per[a] else "-"
                               for a in run.arms)
            out.append(f"| {name} | {cells} |")
    return out


def run_blocks(run: PathRun, path: Any, args: argparse.Namespace, budget_end: float,
               agree: Callable[[Any], Any], gather: Callable[[Any], list[Any]],
               report: Callable[[], None]) -> None:
    """Shuffled rounds until the pilot's rule, ``--rounds``, ``--max-rounds`` or the budget
    says stop (``agree``: rank 0's decision on every rank)."""
    target = args.rounds if args.rounds is not None else max(2, args.pilot)
    needed: int | None = None
    cap: int | None = None
    cap_by = "the time budget"
    sd0 = math.nan
    rnd = 0
    while rnd < target:
        left = budget_end - time.perf_counter()
        if agree(bool(run.round_s) and left < max(run.round_s)):
            og.log(f"{run.name}: stopping after {rnd} rounds (the time budget)")
            break
        t0 = time.perf_counter()
        order = paired.round_order(run.arms, args.seed, rnd)
        run.orders.append(order)
        for arm in order:
            og.collect(args.quick)
            with contextlib.redirect_stdout(io.StringIO()):
                block = path.block(arm, rnd, args.warmup, args.steps)
            ranks = [float(v) for v in gather(block.value_s)]
            run.values[arm][rnd] = max(ranks)
            run.rank_ms[arm][rnd] = [v * 1e3 for v in ranks]
            run.cpu_ms[arm][rnd] = block.cpu_per_step_s * 1e3
            run.others_ms[arm][rnd] = block.others_per_step_s * 1e3
            og.log(f"{run.name} round {rnd} {arm}: {max(ranks) * 1e3:.3f} ms/step "
                   f"(ranks {', '.join(f'{v * 1e3:.3f}' for v in ranks)}), training-thread CPU "
                   f"{block.cpu_per_step_s * 1e3:.2f} ms/step")
        run.round_s.append(time.perf_counter() - t0)
        rnd += 1
        if args.rounds is None and rnd == target:  # the pilot is over
            sd0 = pilot_sd(run.values, run.name)
            needed = paired.rounds_needed(sd0, args.bound_pp)
            left = budget_end - time.perf_counter()
            cap = rnd + max(0, int(left // max(run.round_s)))
            if args.max_rounds < cap:
                cap, cap_by = args.max_rounds, "--max-rounds"
            target = agree(max(rnd, min(needed if needed is not None else rnd, cap)))
            og.log(f"{run.name} pilot: per-round SD {sd0:.3f} pp -> {needed} rounds for "
                   f"+-{args.bound_pp} pp; {cap_by} allows {cap}; running {target}")
        final = pilot_sd(run.values, run.name)
        if args.rounds is None:
            run.plan = paired.Plan(args.pilot, sd0, needed, cap, rnd, final, args.bound_pp,
                                   cap_by)
        else:
            run.plan = paired.Plan(0, final, paired.rounds_needed(final, args.bound_pp), None,
                                   rnd, final, args.bound_pp)
        report()


def run_interleaved(run: PathRun, path: Any, args: argparse.Namespace, budget_end: float,
                    agree: Callable[[Any], Any], gather: Callable[[Any], list[Any]],
                    report: Callable[[], None]) -> None:
    """A pilot run of ``--pilot`` rounds, then one run of the rounds the pilot's noise asks
    for (capped by the budget), each one training run through short blocks of every arm
    (``paths.Schedule``); ``agree``: rank 0's decision on every rank."""
    log_every = int(run.name[len("hf_ls"):]) if run.name.startswith("hf_ls") else 1
    if args.measured_steps % log_every:
        raise ValueError(f"--measured-steps {args.measured_steps} is not a multiple of "
                         f"{run.name}'s logging interval {log_every}")
    first = args.rounds if args.rounds is not None else max(2, args.pilot)
    needed: int | None = None
    cap: int | None = None
    cap_by = "the time budget"
    sd0 = math.nan
    done = 0
    remaining = first  # rounds still to run; after the pilot a training run takes at most
    calls = 0          # --train-rounds of them (each a train() call of its own)
    while remaining > 0:
        chunked = args.train_rounds and (calls > 0 or args.rounds is not None)
        todo = min(remaining, args.train_rounds) if chunked else remaining
        remaining -= todo
        schedule = paths.Schedule(run.arms, todo, done, args.seed, args.measured_steps,
                                  args.burn_steps, args.warmup)
        if args.quick:
            og.collect(True)  # what the previous path imported is out of the collector's sight
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            mine = path.interleaved(schedule)
        wall = time.perf_counter() - t0
        ranks = gather(mine)
        threads = gather((schedule.threads_s, schedule.thread_steps))
        if not run.threads_s:
            run.threads_s = [{} for _ in threads]
            run.thread_steps = [{} for _ in threads]
        for r, (by_arm, steps) in enumerate(threads):
            for arm, by_name in by_arm.items():
                totals = run.threads_s[r].setdefault(arm, {})
                for name, spent in by_name.items():
                    totals[name] = totals.get(name, 0.0) + spent
                run.thread_steps[r][arm] = run.thread_steps[r].get(arm, 0) + steps.get(arm, 0)
        run.orders.extend(schedule.orders)
        run.train_call.update(dict.fromkeys(range(done, done + todo), calls))
        calls += 1
        run.add_profile(schedule.profile_s, todo)
        for (rnd, arm), rec in schedule.steps.items():
            run.steps[arm][rnd] = rec
        split = {key: (statistics.fmean(rec["gap_ms"]), statistics.fmean(rec["busy_ms"]))
                 for key, rec in schedule.steps.items() if rec.get("gap_ms")}
        for r, by_key in enumerate(gather(split)):
            while len(run.split_by_rank) <= r:
                run.split_by_rank.append({a: {} for a in run.arms})
            for (rnd, arm), pair in by_key.items():
                run.split_by_rank[r][arm][rnd] = pair
        for (rnd, arm), (_, cpu_s, others_s) in mine.items():
            per_rank = [r[(rnd, arm)][0] for r in ranks]
            run.values[arm][rnd] = max(per_rank)
            run.rank_ms[arm][rnd] = [v * 1e3 for v in per_rank]
            run.cpu_ms[arm][rnd] = cpu_s * 1e3
            run.others_ms[arm][rnd] = others_s * 1e3
        done += todo
        round_s = max(gather(schedule.round_wall_s))  # steps, starts and stops: the host's
        if not math.isfinite(round_s):
            round_s = wall / todo
        run.round_s.extend([round_s] * todo)
        og.log(f"{run.name}: {todo} rounds in {wall:.0f} s (a round {round_s:.1f} s); "
               f"{done} done")
        if args.rounds is None and needed is None:  # the pilot is over
            sd0 = pilot_sd(run.values, run.name)
            needed = paired.rounds_needed(sd0, args.bound_pp)
            overhead = max(0.0, wall - first * round_s)  # start, warm-up, stop of a run
            left = budget_end - time.perf_counter() - overhead
            # a margin: one run, all or nothing; with --train-rounds each run's start shared
            per_round = round_s + (overhead / args.train_rounds if args.train_rounds else 0.0)
            cap = done + max(0, int(0.85 * left // per_round))
            if args.max_rounds < cap:
                cap, cap_by = args.max_rounds, "--max-rounds"
            wanted = max(done, min(needed if needed is not None else done, cap))
            target = paired.whole_designs(wanted, cap, len(run.arms))
            target = agree(max(done, target))
            remaining = target - done
            whole = (f" (whole designs of {len(paired.williams(len(run.arms)))} rounds)"
                     if target < wanted else "")
            og.log(f"{run.name} pilot: per-round SD {sd0:.3f} pp -> {needed} rounds for "
                   f"+-{args.bound_pp} pp; {cap_by} allows {cap}; running {remaining} more"
                   f"{whole}")
        final = pilot_sd(run.values, run.name)
        if args.rounds is None:
            run.plan = paired.Plan(first, sd0, needed, cap, done, final, args.bound_pp, cap_by)
        else:
            run.plan = paired.Plan(0, final, paired.rounds_needed(final, args.bound_pp), None,
                                   done, final, args.bound_pp)
        report()


def markdown(runs: list[PathRun], meta: dict[str, Any], args: argparse.Namespace) -> str:
    hw = meta["hardware"]
    out = [f"## user paths against their A/A arms: {hw.get('gpu', hw['device'])} x "
           f"{meta['world_size']}, driver {hw.get('driver', '-')}, CUDA {hw.get('cuda', '-')}, "
           f"{hw['cpus']} CPUs; {meta['date']}; commit {meta['commit']}",
           f"model {meta['model']['n_params'] / 1e6:.1f}M params "
           f"{'fp32' if args.quick else 'bf16'}, batch {meta['model']['batch']} x "
           f"{meta['model']['seq_len']} tokens per GPU; each step timed on the GPU timeline "
           f"(on a CPU: the wall clock); monitor interval {args.interval} s; the claim: the "
           f"95 % interval contains 0 and lies within +-{args.bound_pp} pp",
           ("mode interleaved: one training run for the pilot and "
            + (f"one for each {args.train_rounds} rounds of the rest"
               if args.train_rounds else "one for the rest") + ", blocks "
            f"of {args.burn_steps} + {args.measured_steps} steps of each arm in turn, a "
            f"block's value the mean of its last {args.measured_steps} steps; gpulens's "
            f"monitor started and stopped with each of its blocks, in burn-in steps"
            if args.mode == "interleaved" else
            f"mode blocks: one training run per arm and round, {args.steps} timed steps "
            f"(+{args.warmup} warm-up), a block's value the median of its steps; the monitor "
            f"starts and stops with its block") + f"; orders balanced (Williams), seed "
           f"{args.seed}",
           f"versions {json.dumps(meta['versions'])}", ""]
    for run in runs:
        out += [f"### {run.name}", ""]
        if run.failed:
            out += [f"FAILED: {run.failed}", ""]
        if run.plan is not None:
            out += [run.plan.line(), ""]
        out += ["orders: " + "; ".join(f"{i}: {' '.join(o)}" for i, o in enumerate(run.orders)),
                ""]
        comps = run.comparisons(args.seed)
        out.append(paired.table(comps, args.bound_pp))
        out += ["", *paired.bias_notes(comps)]
        out += ["", "| arm | step (ms), median of rounds | training-thread CPU (ms/step) | "
                "other threads' CPU (ms/step; this rank's process) |", "|---|---|---|---|"]
        for arm in run.arms:
            v, c, o = run.values[arm], run.cpu_ms[arm], run.others_ms[arm]
            if v:
                others = f"{statistics.median(o.values()):.2f}" if o else "-"
                out.append(f"| {arm} | {statistics.median(v.values()) * 1e3:.3f} | "
                           f"{statistics.median(c.values()):.2f} | {others} |")
        out += threads_table(run)
        out += noise_table(run)
        out += profile_table(run)
        out.append("")
    return "\n".join(out)


def noise_table(run: PathRun) -> list[str]:
    """What the counted steps of each arm look like one by one (rank 0): their spread, the
    slow ones (over the arm's median + 5 ms), and the garbage collector's share: whether a
    path's per-round noise is many small differences or a few slow steps, and whose."""
    out: list[str] = []
    for arm in run.arms:
        recs = list(run.steps[arm].values())
        ms = [v for r in recs for v in r["ms"]]
        if len(ms) < 2:
            continue
        if not out:
            out = ["", "counted steps one by one (rank 0): slow = over the arm's median + 5 ms; "
                   "gc = the garbage collector's time in the step", "",
                   "| arm | steps | median (ms) | p99 (ms) | max (ms) | slow steps | slow steps' "
                   "excess (ms/step, all steps) | gc (ms/step) | full collections | slow steps "
                   "with gc > 1 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
        med = statistics.median(ms)
        p99 = sorted(ms)[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
        pairs = [(v, g) for r in recs for v, g in zip(r["ms"], r["gc_ms"], strict=True)]
        slow = [(v, g) for v, g in pairs if v > med + 5.0]
        excess = sum(v - med for v, _ in slow) / len(ms)
        gc_ms = statistics.fmean(g for _, g in pairs)
        full = sum(int(f) for r in recs for f in r["full_gc"])
        out.append(f"| {arm} | {len(ms)} | {med:.2f} | {p99:.2f} | {max(ms):.2f} | {len(slow)} "
                   f"| {excess:.3f} | {gc_ms:.3f} | {full} | "
                   f"{sum(1 for _, g in slow if g > 1.0)} |")
    return out + split_table(run) + variants_table(run)


def split_table(run: PathRun) -> list[str]:
    """Where an arm's extra time sits (rank 0): per round, the mean of its steps' *gap* (the
    previous step's end to this step's first forward, on the GPU's timeline: the host's work
    between steps, HF's log after its sync included) and *busy* part (that forward to the
    step's end), less the baseline's; mean and 95 % interval over the rounds (ms)."""
    if not any(by_arm.get(run.name) for by_arm in run.split_by_rank):
        return []
    ranks = len(run.split_by_rank)
    out = ["", f"each step split at its first forward: gap = the previous step's end to that "
           f"forward, busy = the rest (ms, mean of rounds; difference to {run.name} per round, "
           f"mean [95 % CI]; in DDP a rank's busy part holds its wait for the others)", "",
           "| rank | arm | gap (ms) | busy (ms) | gap - baseline (ms) | busy - baseline (ms) |",
           "|---|---|---|---|---|---|"]
    for rank, by_arm in enumerate(run.split_by_rank):
        base = by_arm.get(run.name, {})
        for arm in run.arms:
            mine = by_arm.get(arm, {})
            cells, diffs = [], []
            for i in (0, 1):
                cells.append(f"{statistics.fmean(v[i] for v in mine.values()):.3f}"
                             if mine else "-")
                d = {r: v[i] - base[r][i] for r, v in mine.items() if r in base}
                if arm == run.name or len(d) < 2:
                    diffs.append("-")
                    continue
                e = paired.Estimate.of(d)
                diffs.append(f"{e.mean:+.3f} [{e.lo:+.3f}, {e.hi:+.3f}]")
            out.append(f"| {rank if ranks > 1 else 0} | {arm} | {' | '.join(cells)} | "
                       f"{' | '.join(diffs)} |")
    return out


def variants_vs_gpulens(run: PathRun, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Each ``--variants`` arm against the default gpulens arm of the same rounds: per round,
    gpulens's difference to the baseline minus the variant's (pp; positive: the variant is
    cheaper), and each rank's gap and busy part, gpulens's minus the variant's (ms): what the
    variant's setting takes away, paired."""
    main = f"{run.name}_gpulens"
    out: dict[str, dict[str, Any]] = {}
    for arm, total in paired.variants_minus(run.values, run.name).items():
        if len(total) < 2:
            continue
        parts: list[dict[str, Any]] = []
        for by_arm in run.split_by_rank:
            mine, theirs = by_arm.get(main, {}), by_arm.get(arm, {})
            rank_parts: dict[str, Any] = {}
            for i, part in ((0, "gap_ms"), (1, "busy_ms")):
                d = {r: v[i] - theirs[r][i] for r, v in mine.items() if r in theirs}
                if len(d) >= 2:
                    e = paired.Estimate.of(d, seed)
                    rank_parts[part] = {"mean": e.mean, "ci95": [e.lo, e.hi], "n": e.n}
            parts.append(rank_parts)
        e = paired.Estimate.of(total, seed)
        out[arm] = {"total_pp": {"mean": e.mean, "ci95": [e.lo, e.hi], "n": e.n},
                    "by_rank": parts}
    return out


def variants_table(run: PathRun, seed: int = 0) -> list[str]:
    """:func:`variants_vs_gpulens` as a table (empty without variants)."""
    found = variants_vs_gpulens(run, seed)
    if not found:
        return []
    main = f"{run.name}_gpulens"

    def fmt(d: dict[str, Any] | None) -> str:
        if not d:
            return "-"
        lo, hi = d["ci95"]
        return f"{d['mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    out = ["", f"{main} minus each variant, paired per round (positive: the variant's setting "
           f"takes that much away; total in pp of the baseline's step, parts in ms, mean "
           f"[95 % CI])", "", "| variant | total (pp) | rank | gap (ms) | busy (ms) |",
           "|---|---|---|---|---|"]
    for arm, got in found.items():
        ranks = got["by_rank"] or [{}]
        for rank, parts in enumerate(ranks):
            out.append(f"| {arm} | {fmt(got['total_pp']) if rank == 0 else ''} | {rank} | "
                       f"{fmt(parts.get('gap_ms'))} | {fmt(parts.get('busy_ms'))} |")
    return out


def profile_table(run: PathRun) -> list[str]:
    """Each arm's mean step at each position of its blocks, less the baseline's at the same
    position (ms; rank 0; the first ``--burn-steps`` positions are burn-in): a start-up
    transient shows in the first positions, a steady cost in every one."""
    prof = run.profile_ms()
    base = prof.get(run.name)
    if not base:
        return []
    out = ["", f"step by position in the block, minus {run.name}'s at that position (ms; "
           f"rank 0; the first positions are burn-in; {run.name}'s own in its row)", "",
           "| arm | " + " | ".join(str(i) for i in range(len(base))) + " |",
           "|---|" + "---|" * len(base)]
    for arm in run.arms:
        steps = prof.get(arm)
        if not steps:
            continue
        cells = [f"{v:.1f}" if arm == run.name else f"{v - b:+.2f}"
                 for v, b in zip(steps, base, strict=True)]
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    paths.bench_options_from_env()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--paths", default="hf_ls1,hf_ls10,lightning,wandb_loop")
    p.add_argument("--quick", action="store_true",
                   help="CPU (gloo under torchrun), tiny model, simulated GPUs: a smoke run")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="seconds of rounds per path (no round starts that would end later)")
    p.add_argument("--bound-pp", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=None, help="exactly this many (no pilot)")
    p.add_argument("--pilot", type=int, default=4)
    p.add_argument("--max-rounds", type=int, default=80)
    p.add_argument("--mode", choices=("interleaved", "blocks"), default="interleaved",
                   help="interleaved: one training run through short blocks of every arm, "
                   "gpulens started and stopped with each of its blocks; blocks: one training "
                   "run per arm and round")
    p.add_argument("--measured-steps", type=int, default=20,
                   help="interleaved: counted steps per block (a multiple of the logging "
                   "interval)")
    p.add_argument("--train-rounds", type=int, default=None,
                   help="interleaved: at most this many rounds a training run after the pilot "
                   "(several train() calls in this process, each round tagged with its call)")
    p.add_argument("--burn-steps", type=int, default=5,
                   help="interleaved: steps at the start of a block left out (gpulens's start "
                   "or stop, the previous block's last log and rows land there)")
    p.add_argument("--steps", type=int, default=None, help="blocks: timed steps per block")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run")
    p.add_argument("--interval", type=float, default=0.1, help="gpulens's sampling period")
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--seed", type=int, default=None,
                   help="the orders' seed (default: drawn afresh, recorded; runs to be pooled "
                   "need different seeds)")
    p.add_argument("--lightning-dsm", action="store_true",
                   help="add Lightning's DeviceStatsMonitor as a fourth arm of the lightning path")
    p.add_argument("--variants", type=parse_variants, default={},
                   help="HF paths: extra gpulens arms, NAME=JSON;... of the callback's "
                   "attributes (settings fields under \"monitor\"), e.g. "
                   "'jsonl={\"follow_report_to\": false};bare={\"count_work\": false, "
                   "\"time_phases\": false}'")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 20)
    args.warmup = max(2, args.warmup or (2 if args.quick else 3))
    og.quiet_libraries()
    if args.quick:
        os.environ["GPULENS_BACKEND"] = "simulated"
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    names = [x.strip() for x in args.paths.split(",") if x.strip()]
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    allowed = DDP_PATHS if distributed else PATHS
    bad = [n for n in names if n not in allowed]
    if bad:
        print(f"paths_aa.py: unknown path(s) {bad}{' under torchrun' if distributed else ''}; "
              f"known: {', '.join(allowed)}", file=sys.stderr)
        return 2
    import torch

    rank, world, device = 0, 1, None
    agree: Callable[[Any], Any] = lambda x: x  # noqa: E731
    gather: Callable[[Any], list[Any]] = lambda x: [x]  # noqa: E731
    if distributed:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and not args.quick
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        ctrl = dist.new_group(backend="gloo")
        device = f"cuda:{local}" if cuda else "cpu"

        def agree(x: Any) -> Any:
            box = [x]
            dist.broadcast_object_list(box, src=0, group=ctrl)
            return box[0]

        def gather(x: Any) -> list[Any]:
            out: list[Any] = [None] * world
            dist.all_gather_object(out, x, group=ctrl)
            return out

    if args.seed is None:
        args.seed = agree(paired.fresh_seed())  # rank 0's draw on every rank
    t_start = time.perf_counter()
    if rank == 0:
        s = og.setup(args.quick, args.target_ms, args.batch, args.seq, device)
        agree(s.batch_size)
    else:
        s = og.setup(args.quick, args.target_ms, agree(None), args.seq, device)
    if args.quick:
        s.model.float()  # bf16 products are slow on a CPU
    out_path = args.json or (Path(os.environ["OUT"]) / "paths_aa.json" if os.environ.get("OUT")
                             else None)
    tmpdir = tempfile.TemporaryDirectory(prefix=f"gpulens-paths-{rank}-")
    tmp = Path(tmpdir.name)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": og.git_commit(),
        "quick": args.quick, "paths": names, "world_size": world, "hardware": og.hardware(s),
        "versions": og.versions(), "setup_s": time.perf_counter() - t_start,
        "model": {"n_params": s.n_params, "n_layer": s.config.n_layer,
                  "seq_len": s.seq_len, "batch": s.batch_size},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": " ".join([sys.executable, *sys.argv]),
    }
    runs: list[PathRun] = []

    def report() -> None:
        if rank == 0 and out_path is not None:
            doc = {"meta": meta, "paths": {r.name: r.as_dict(args.seed, args.bound_pp)
                                           for r in runs}}
            out_path.write_text(json.dumps(doc, indent=2, default=str))

    wandb_run = None
    if rank == 0:
        with contextlib.redirect_stdout(io.StringIO()):
            wandb_run = paths.open_wandb_run(tmp, "paths-aa", args.quick)
    if args.quick:
        og.collect(True)
    try:
        for name in names:
            run = PathRun(name, args.lightning_dsm,
                          args.variants if name.startswith("hf_ls") else ())
            runs.append(run)
            path = make_path(name, s, tmp, args)
            runner = run_interleaved if args.mode == "interleaved" else run_blocks
            try:
                runner(run, path, args, time.perf_counter() + args.budget_s, agree, gather,
                       report)
            except Exception as exc:  # one path failing must not take the others' figures
                run.failed = f"{type(exc).__name__}: {exc}"
                og.log(f"{name} failed: {exc!r}")
                report()
                if distributed:
                    raise  # the other ranks cannot go on alone
    finally:
        if wandb_run is not None:
            with contextlib.redirect_stdout(io.StringIO()):
                og.wandb_finish(wandb_run)
        tmpdir.cleanup()
    if rank == 0:
        print(markdown(runs, meta, args))
    if distributed:
        import torch.distributed as dist

        dist.barrier(group=ctrl)
        dist.destroy_process_group()
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
