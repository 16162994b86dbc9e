"""What the framework callbacks cost the training thread per step, on a CPU (issue 18).

One process, a tiny GPT-2 built in code (2 layers, 64 wide, 64 tokens; fp32; one torch thread,
so the model's own work stays on the training thread and its CPU time is the step's), run
through the user paths of ``paths.py``: the Hugging Face ``Trainer`` (``report_to`` none or an
offline W&B run opened once for every block) and Lightning (a CSV logger), logging every
``--log-every`` steps, with token rows that carry an attention mask. Each group has three arms:
the baseline, its A/A arm (the same code again) and the baseline with gpulens's callback. A
round runs every arm once as a block (``--warmup`` + ``--steps`` steps) in a balanced, seeded
order (``paired.round_order``); gpulens's monitor starts and stops with its block, outside the
timed steps.

Per block, from a stamp at the end of each step: the training thread's CPU time per step
(``time.thread_time``; the median of the block's timed steps), and for the gpulens arm the CPU
time spent *inside* gpulens on the training thread: each hook of the callback (inclusive of
``Monitor.log``, the phase marks, the loggers a Lightning row is written to), and Hugging
Face's forward pre-hook that counts tokens (``TokenCounter.observe``), summed over the timed
steps and divided by their number. Printed per group: each arm's training-thread CPU per
step, the CPU of the process's other threads per step (``paths.Clock.others``; in the gpulens
blocks split by thread name: gpulens's threads take the GIL from the training thread), the
paired per-round differences (gpulens - base, and base_b - base, the A/A envelope) in
microseconds with a 95 % bootstrap interval, and the in-gpulens breakdown.

``--profile`` runs one more gpulens block of each group under ``cProfile`` (the training
thread only) and prints gpulens's functions by cumulative time per step.

    PYTHONPATH=src python benchmarks/callback_cost.py --rounds 10 --json out.json
    PYTHONPATH=/tmp/old/src python benchmarks/callback_cost.py ...   # another tree, same script

Nothing is asserted; the figures depend on the machine. Compare trees by running the script
against each, interleaved, on one machine (the README of the results folder says how).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # the model and W&B helpers
import paired  # the bootstrap interval and the seeded round order
import paths  # the blocks

HF_HOOKS = ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "on_log",
            "on_epoch_begin", "on_evaluate", "on_save")
LIGHTNING_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end",
                   "on_train_epoch_start", "on_validation_end")
GROUPS = ("hf", "hf_wandb", "lightning")


class Meter:
    """Training-thread CPU inside wrapped functions: inclusive per label, and the outermost
    calls' total (nested calls counted once)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.total = 0.0
        self._depth = 0
        self.frozen: dict[str, float] | None = None
        self.start: dict[str, float] = {}

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                dt = time.thread_time() - t0
                self.sums[label] = self.sums.get(label, 0.0) + dt
                if self._depth == 0:
                    self.total += dt
        return wrapper

    def snapshot(self) -> dict[str, float]:
        return {**self.sums, "(all gpulens, nested once)": self.total}

    def window(self, first: int, last: int) -> Callable[[int], None]:
        """A clock listener: keep the sums between stamps ``first`` and ``last``."""
        def listen(index: int) -> None:
            if index == first:
                self.start = self.snapshot()
            elif index == last:
                self.frozen = self.snapshot()
        return listen

    def per_step_us(self, steps: int) -> dict[str, float]:
        end = self.frozen or self.snapshot()
        return {k: 1e6 * (v - self.start.get(k, 0.0)) / max(1, steps) for k, v in end.items()}


COUNTER = Meter()
"""The token counter's meter: its method is wrapped once per process (class level)."""


def wrap_token_counter() -> Callable[[], None]:
    """Time ``TokenCounter.observe`` (HF's forward pre-hook, Lightning's batch hook), where
    the tree counts work at all (older trees do not); returns what puts it back."""
    try:
        from gpulens.work import hf
    except ImportError:
        return lambda: None

    observe = hf.TokenCounter.observe
    hf.TokenCounter.observe = COUNTER.timed(  # type: ignore[method-assign]
        "TokenCounter.observe", observe)

    def unwrap() -> None:
        hf.TokenCounter.observe = observe  # type: ignore[method-assign]

    return unwrap


@dataclass
class GroupResult:
    name: str
    blocks: dict[str, list[paths.Block]] = field(default_factory=dict)
    inside: list[dict[str, float]] = field(default_factory=list)
    profile: str = ""


def instrumenter(hooks: tuple[str, ...], warmup: int, steps: int,
                 sink: list[dict[str, float]]) -> Callable[[Any, paths.Clock], None]:
    """Wraps a callback's hooks; the block's in-gpulens figures go to ``sink``."""

    def instrument(callback: Any, clock: paths.Clock) -> None:
        meter = Meter()
        for hook in hooks:
            fn = getattr(callback, hook, None)
            if callable(fn):
                setattr(callback, hook, meter.timed(hook, fn))
        first, last = warmup - 1, warmup + steps - 1
        clock.listeners.append(meter.window(first, last))
        clock.listeners.append(COUNTER.window(first, last))
        threads_at: dict[str, float] = {}
        figures_of_threads: dict[str, float] = {}

        def thread_window(index: int) -> None:
            if index == first:
                threads_at.update(paths.threads_cpu())
            elif index == last:
                for name, t in paths.threads_cpu().items():
                    key = f"thread {name}"
                    figures_of_threads[key] = 1e6 * (t - threads_at.get(name, 0.0)) / steps

        clock.listeners.append(thread_window)

        def collect(index: int) -> None:
            if index == last:
                figures = meter.per_step_us(steps)
                counter = COUNTER.per_step_us(steps)
                figures["TokenCounter.observe"] = counter.get("TokenCounter.observe", 0.0)
                if "on_train_batch_start" not in figures:  # HF: the hook runs outside them
                    figures["(all gpulens, nested once)"] += figures["TokenCounter.observe"]
                sink.append({**figures, **figures_of_threads})
        clock.listeners.append(collect)

    return instrument


def build(args: argparse.Namespace) -> og.Setup:
    """The tiny model in fp32 on the CPU, warmed."""
    import torch

    s = og.setup(True, 0.0, args.batch, args.seq, "cpu")
    s.model.float()
    s.optimizer = og.make_optimizer(torch, s.model, s.device)
    for i in range(3):
        og.train_step(s, i)
    return s


def make_path(group: str, s: og.Setup, tmp: Path, args: argparse.Namespace) -> Any:
    if group == "hf":
        return paths.HfPath(s, tmp, args.log_every, [], args.interval)
    if group == "hf_wandb":
        return paths.HfPath(s, tmp, args.log_every, ["wandb"], args.interval)
    if group == "lightning":
        return paths.LightningPath(s, tmp, args.log_every, args.interval)
    raise ValueError(f"unknown group {group!r}; known: {', '.join(GROUPS)}")


def run_group(group: str, s: og.Setup, tmp: Path, args: argparse.Namespace) -> GroupResult:
    path = make_path(group, s, tmp, args)
    hooks = LIGHTNING_HOOKS if group == "lightning" else HF_HOOKS
    res = GroupResult(group, {a: [] for a in (group, paired.aa_name(group), f"{group}_gpulens")})
    arms = list(res.blocks)
    for rnd in range(args.rounds):
        for arm in paired.round_order(arms, args.seed, rnd):
            if args.quick:
                og.collect(True)  # the collection after each block scans only what it made
            instrument = instrumenter(hooks, args.warmup, args.steps, res.inside)
            with contextlib.redirect_stdout(io.StringIO()):
                block = path.block(arm, rnd, args.warmup, args.steps, instrument)
            res.blocks[arm].append(block)
            og.log(f"{group} round {rnd} {arm}: CPU {block.cpu_per_step_s * 1e3:.3f} ms/step, "
                   f"wall {block.value_s * 1e3:.3f} ms/step")
    if args.profile:
        prof = cProfile.Profile(time.thread_time)  # CPU of the training thread, not wall

        def profiled(callback: Any, clock: paths.Clock) -> None:
            clock.listeners.append(lambda i: prof.enable() if i == args.warmup - 1 else
                                   prof.disable() if i == args.warmup + args.steps - 1 else None)

        with contextlib.redirect_stdout(io.StringIO()):
            path.block(f"{group}_gpulens", args.rounds, args.warmup, args.steps, profiled)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(r"gpulens[/\\]", 25)
        res.profile = out.getvalue()
    return res


def summarize(res: GroupResult, seed: int) -> dict[str, Any]:
    base = res.name
    cpu = {a: {b.round: b.cpu_per_step_s for b in bl} for a, bl in res.blocks.items()}
    wall = {a: {b.round: b.value_s for b in bl} for a, bl in res.blocks.items()}
    others = {a: {b.round: b.others_per_step_s for b in bl} for a, bl in res.blocks.items()}
    arms = {a: {"cpu_ms_per_step": statistics.median(cpu[a].values()) * 1e3,
                "other_threads_cpu_ms_per_step": statistics.median(others[a].values()) * 1e3,
                "wall_ms_per_step": statistics.median(wall[a].values()) * 1e3,
                "per_round_cpu_ms": [cpu[a][r] * 1e3 for r in sorted(cpu[a])]}
            for a in res.blocks}
    diffs = {}
    for arm in res.blocks:
        if arm == base:
            continue
        d = [1e6 * (cpu[arm][r] - cpu[base][r]) for r in sorted(cpu[arm]) if r in cpu[base]]
        m, lo, hi = paired.mean_ci(d, seed)
        diffs[arm] = {"mean_us": m, "ci95_us": [lo, hi], "per_round_us": d}
    inside: dict[str, float] = {}
    for label in sorted({k for f in res.inside for k in f}):
        inside[label] = statistics.fmean(f.get(label, 0.0) for f in res.inside)
    return {"arms": arms, "differences": diffs, "inside_gpulens_us_per_step": inside,
            "profile": res.profile}


def fmt_us(x: float) -> str:
    return f"{x:+.1f}"


def report(groups: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"## training-thread CPU per step, {meta['date']}, commit {meta['commit']}, "
             f"gpulens from {meta['gpulens_from']}",
             f"tiny GPT-2 fp32 on the CPU ({meta['n_params'] / 1e6:.2f}M params, batch "
             f"{meta['batch']} x {meta['seq']} tokens), one torch thread; {meta['rounds']} rounds "
             f"x {meta['steps']} timed steps (+{meta['warmup']} warm-up) per arm; logging every "
             f"{meta['log_every']} step(s); monitor interval {meta['interval']} s; "
             f"load average {meta['load']}", ""]
    for name, g in groups.items():
        lines += [f"### {name}", "",
                  "| arm | training-thread CPU (ms/step), median of rounds | other threads' "
                  "CPU (ms/step) | wall (ms/step) | minus the baseline (us/step): mean [95 % CI] |",
                  "|---|---|---|---|---|"]
        for arm, f in g["arms"].items():
            d = g["differences"].get(arm)
            cell = "-" if d is None else (f"{fmt_us(d['mean_us'])} [{fmt_us(d['ci95_us'][0])}, "
                                          f"{fmt_us(d['ci95_us'][1])}]")
            lines.append(f"| {arm} | {f['cpu_ms_per_step']:.3f} "
                         f"| {f['other_threads_cpu_ms_per_step']:.3f} "
                         f"| {f['wall_ms_per_step']:.3f} | {cell} |")
        lines += ["", "inside gpulens on the training thread (us/step, mean of the gpulens "
                  "blocks; hooks inclusive), and the CPU of the process's other threads by name "
                  "(us/step, `thread ...`):", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in g["inside_gpulens_us_per_step"].items()]
        if g["profile"]:
            lines += ["", "```", g["profile"].strip(), "```"]
        lines.append("")
    return "\n".join(lines)


def summarize_files(files: list[Path]) -> str:
    """One table over several runs' JSON (trees and repetitions): per run and group, the CPU
    spent inside gpulens per step, the per-hook split, and the end-to-end differences."""
    lines = ["| run | gpulens from | group | inside gpulens (us/step) | of which: token counter "
             "/ busiest hook (us/step) | gpulens - base (us/step) [95 % CI] | A/A: base_b - "
             "base (us/step) [95 % CI] | load average |", "|---|---|---|---|---|---|---|---|"]
    for f in files:
        doc = json.loads(f.read_text())
        meta = doc["meta"]
        for group, g in doc["groups"].items():
            inside = g["inside_gpulens_us_per_step"]
            hooks = {k: v for k, v in inside.items()
                     if k.startswith("on_") and k != "TokenCounter.observe"}
            busiest = max(hooks, key=lambda k: hooks[k]) if hooks else "-"
            d = g["differences"]

            def cell(arm: str, d: dict[str, Any] = d) -> str:
                x = d.get(arm)
                if x is None:
                    return "-"
                return (f"{fmt_us(x['mean_us'])} [{fmt_us(x['ci95_us'][0])}, "
                        f"{fmt_us(x['ci95_us'][1])}]")

            lines.append(
                f"| {f.name} | {Path(meta['gpulens_from']).parent.parent.name} | {group} "
                f"| {inside.get('(all gpulens, nested once)', math.nan):.1f} "
                f"| {inside.get('TokenCounter.observe', 0.0):.1f} / {busiest} "
                f"{hooks.get(busiest, math.nan):.1f} | {cell(f'{group}_gpulens')} "
                f"| {cell(paired.aa_name(group))} | {meta['load']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--groups", default="hf,hf_wandb,lightning",
                   help=f"comma-separated: {', '.join(GROUPS)}")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="one more gpulens block per group "
                   "under cProfile")
    p.add_argument("--quick", action="store_true", help="2 rounds of 6 steps: a smoke run")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print one table over earlier runs' JSON files and exit")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize_files(args.summarize))
        return 0
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 6, 2
    args.warmup = max(2, args.warmup)
    og.quiet_libraries()
    os.environ.setdefault("GPULENS_BACKEND", "simulated")
    os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
    import logging

    logging.getLogger("gpulens").setLevel(logging.ERROR)  # the advice rules fire on a CPU
    import gpulens

    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        print(f"callback_cost.py: unknown group(s) {bad}; known: {', '.join(GROUPS)}",
              file=sys.stderr)
        return 2
    s = build(args)
    unwrap = wrap_token_counter()
    tmpdir = tempfile.TemporaryDirectory(prefix="gpulens-callback-cost-")
    tmp = Path(tmpdir.name)
    run = None
    if "hf_wandb" in groups:
        with contextlib.redirect_stdout(io.StringIO()):
            run = paths.open_wandb_run(tmp, "callback-cost")
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": og.git_commit(),
        "gpulens_from": str(Path(gpulens.__file__).resolve().parent),
        "n_params": s.n_params, "batch": s.batch_size, "seq": s.seq_len,
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "log_every": args.log_every, "interval": args.interval, "versions": og.versions(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    out: dict[str, dict[str, Any]] = {}
    try:
        for group in groups:
            out[group] = summarize(run_group(group, s, tmp, args), args.seed)
            if args.json is not None:
                args.json.write_text(json.dumps({"meta": meta, "groups": out}, indent=2))
    finally:
        unwrap()
        if run is not None:
            with contextlib.redirect_stdout(io.StringIO()):
                og.wandb_finish(run)
        tmpdir.cleanup()
    print(report(out, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
