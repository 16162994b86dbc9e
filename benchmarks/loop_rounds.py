"""Rounds of arms over the plain GPT-2-small-sized loop of ``overhead_gpu.py``, each step timed
on the GPU's timeline: what ``session_parts.py`` and ``nvml_interference.py`` share.

A round runs every arm once, in a balanced, seeded order (``paired.round_order``), as a block of
``--burn`` + ``--steps`` steps; a block's value is the mean of its measured steps, and each
position of the blocks is averaged over the rounds too (a start-up transient against a steady
cost). Rounds go on until ``--max-rounds`` or, after the first two, ``--budget-s``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import overhead_gpu as og
import paired


def add_args(p: argparse.ArgumentParser, *, burn: int, max_rounds: int) -> None:
    """The options every such script has."""
    p.add_argument("--target-ms", type=float, default=100.0, help="the step to size the batch for")
    p.add_argument("--burn", type=int, default=burn, help="steps of a block not counted")
    p.add_argument("--steps", type=int, default=20, help="steps of a block counted")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds of rounds")
    p.add_argument("--max-rounds", type=int, default=max_rounds)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: 2 tiny rounds")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)


class StepClock:
    """A stamp at the end of each step: a CUDA event on the device (no sync), else the host's
    clock; :meth:`times` reads the seconds between stamps once the block is over."""

    def __init__(self, s: og.Setup) -> None:
        self.cuda = s.device.type == "cuda"
        self.torch = s.torch
        self.stamps: list[Any] = []

    def stamp(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())

    def times(self) -> list[float]:
        if self.cuda:
            self.stamps[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.stamps)]
        return [b - a for a, b in itertools.pairwise(self.stamps)]


@dataclass
class Rounds:
    """Every block's value (``values[arm][round]``, seconds a step) and each arm's mean step
    at each position of its blocks (``profile_s``)."""

    arms: Sequence[str]
    values: dict[str, dict[int, float]] = field(default_factory=dict)
    profile_s: dict[str, list[float]] = field(default_factory=dict)
    rounds: int = 0

    def run(self, args: argparse.Namespace, block: Callable[[str, int], list[float]],
            json_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        """``block(arm, first_step)``: the seconds of each of the block's steps, burn-in
        included."""
        sums = {a: [0.0] * (args.burn + args.steps) for a in self.arms}
        self.values = {a: {} for a in self.arms}
        t_end = time.monotonic() + args.budget_s
        step = 1000
        while self.rounds < args.max_rounds and (self.rounds < 2 or time.monotonic() < t_end):
            rnd = self.rounds
            for arm in paired.round_order(list(self.arms), args.seed, rnd):
                times = block(arm, step)
                step += args.burn + args.steps
                self.values[arm][rnd] = statistics.fmean(times[args.burn:])
                sums[arm] = [a + b for a, b in zip(sums[arm], times, strict=True)]
            self.rounds += 1
            self.profile_s = {a: [v / self.rounds for v in sums[a]] for a in self.arms}
            og.log(f"round {self.rounds}: " + ", ".join(
                f"{a} {self.values[a][rnd] * 1e3:.2f}" for a in self.arms))
            if args.json:  # after every round: a time limit still leaves figures
                args.json.write_text(json.dumps(self.as_dict(args, json_extra), default=str))

    def comparisons(self, baseline: str, seed: int) -> list[paired.Comparison]:
        return paired.compare(self.values, dict.fromkeys(self.arms, baseline), seed=seed)

    def profile_table(self, baseline: str, burn: int) -> list[str]:
        """Each arm's step by position in its blocks, less the baseline's (ms)."""
        base = self.profile_s[baseline]
        out = [f"step by position in the block (ms, mean of rounds), less {baseline}'s; the "
               f"first {burn} are burn-in", "",
               "| arm | " + " | ".join(str(i) for i in range(len(base))) + " |",
               "|---|" + "---|" * len(base)]
        for arm in self.arms:
            cells = [f"{1e3 * v:.1f}" if arm == baseline else f"{1e3 * (v - b):+.2f}"
                     for v, b in zip(self.profile_s[arm], base, strict=True)]
            out.append(f"| {arm} | " + " | ".join(cells) + " |")
        return out

    def as_dict(self, args: argparse.Namespace,
                extra: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"values": self.values, "rounds": self.rounds,
                "profile_ms": {a: [1e3 * v for v in p] for a, p in self.profile_s.items()},
                "args": vars(args), **(extra() if extra is not None else {})}


def write(args: argparse.Namespace, lines: Sequence[str], rounds: Rounds, baseline: str,
          extra: dict[str, Any], s: og.Setup) -> None:
    """Print the report, and write it (``--md``) and the figures (``--json``)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        comps = rounds.comparisons(baseline, args.seed)
        args.json.write_text(json.dumps({
            **rounds.as_dict(args), **extra, "comparisons": [c.as_dict() for c in comps],
            "versions": og.versions(), "hardware": og.hardware(s)}, indent=1, default=str))
