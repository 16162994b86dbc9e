"""The loader's pace (``gpulens.tune.pace``) at its edges, with the plain ``gpulens.tune.tune`` on
a CPU: sleeps for the step and the loader (:mod:`tests.support.tune_load`), so the costs hold on
a loaded machine.

1. **Just short of the target**: a 100 ms step, one worker a few percent too slow (steady wait
   5.2 % and 5.7 %, over the 5 % target), the first step of each trial 20 or 30 ms slower. The
   window reads under the target; does the trial, and does the sweep choose two workers?
2. **A loader that keeps up, jittery steps**: 10 ms a batch against 25-75 ms steps (uniform),
   three timed steps, one or two workers, ``--repeat`` trials each, read by the workers'
   service times and by their gaps alone (:data:`ARMS`): how many read ``loader pace``, what
   wait, and what time per batch.
3. **A lumpy loader that keeps up on average**: one worker, 20 ms a batch but one in ten 150
   ms (33 ms on average), against 50 ms steps; a long window (150 steps) and ``--repeat``
   short ones (3 steps): one slow batch among a short window's few must not set the pace.

Prints a table per case and writes ``--out`` (Markdown).

    python benchmarks/tune_pace_cases.py --out /tmp/pace-cases.md     # about 2 minutes
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gpulens.tune import Trial, pace, tune  # noqa: E402
from tests.support.tune_load import SlowSamples, collate_numpy  # noqa: E402

BATCH = 16


class Step:
    """A real optimizer step of a tiny model plus a sleep of ``busy_s`` (times a uniform draw
    in ``1 +- jitter``); the first step after a pause (a new trial's) ``extra_s`` longer."""

    def __init__(self, busy_s: float, extra_s: float = 0.0, jitter: float = 0.0,
                 seed: int = 0) -> None:
        self.busy_s, self.extra_s, self.jitter = busy_s, extra_s, jitter
        self.rng = random.Random(seed)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.last: float | None = None

    def __call__(self, batch: Any) -> None:
        now = time.perf_counter()
        first = self.last is None or now - self.last > 0.5 * self.busy_s
        draw = self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        time.sleep(draw * self.busy_s + (self.extra_s if first else 0.0))
        x, y = (torch.as_tensor(a) for a in batch)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.last = time.perf_counter()


def loader(per_batch_s: float, workers: int) -> DataLoader[Any]:
    """Workers started by fork: case 2's "gaps only" arm relies on them inheriting this
    process's ``pace._wrapped`` (spawned ones import the module afresh and wrap)."""
    import multiprocessing

    return DataLoader(SlowSamples(n=4096, per_sample_s=per_batch_s / BATCH), batch_size=BATCH,
                      num_workers=workers, collate_fn=collate_numpy,
                      multiprocessing_context=multiprocessing.get_context("fork")
                      if workers > 0 else None)


def near_target() -> list[str]:
    rows = ["| loader a batch | steady wait (nominal) | first step longer by "
            "| one worker's wait (from) | workers chosen |", "|---|---|---|---|---|"]
    busy = 0.1  # the sleep; the step is about 1 ms longer (the model's own step)
    for short in (0.07, 0.08):
        per_batch = busy * (1 + short)
        for extra in (0.02, 0.03):
            step = Step(busy, extra)
            seen: list[Trial] = []
            result = tune(loader(per_batch, 1), step, model=step.model,
                          optimizer=step.optimizer, batch_sizes=(BATCH,), workers=(1, 2),
                          steps=10, loader_options=False, confirm=False, progress=False)
            seen = [t for t in result.trials if t.config.num_workers == 1 and t.ok]
            one = ", ".join(f"{t.data_wait_pct:.1f} % ({t.data_wait_by})" for t in seen
                            if t.data_wait_pct is not None)
            # the steady wait: the trial's busy time (the pace keeps it) against the loader's
            first = seen[0] if seen else None
            steady = ("-" if first is None or first.step_s is None or first.data_wait_s is None
                      else f"{100 * (1 - (first.step_s - first.data_wait_s) / per_batch):.1f} %")
            chosen = result.chosen.config.num_workers if result.chosen else "-"
            rows.append(f"| {1000 * per_batch:.0f} ms | {steady} | {1000 * extra:.0f} ms | "
                        f"{one or '-'} | {chosen} |")
    return rows


ARMS = ("service times", "gaps only")
"""Case 2's two readings of a worker's time per batch, side by side (the same seeds, one
after the other): the workers' service times (finish less start), and the gaps between their
finishes alone (the sixteenth session's reading: the workers, forked from this process, find
their fetchers counted as wrapped and note no starts)."""


def jittery(repeat: int) -> list[str]:
    rows = ["| workers | reading | trials | read `loader pace` | their waits "
            "| `loader_batch_s`, median |", "|---|---|---|---|---|---|"]
    for workers in (1, 2):
        paced: dict[str, list[float]] = {arm: [] for arm in ARMS}
        per_batch: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for seed in range(repeat):
            for arm in ARMS:
                if arm == "gaps only":
                    pace._wrapped.append(True)  # inherited by the forked workers
                try:
                    step = Step(0.05, jitter=0.5, seed=seed)
                    result = tune(loader(0.01, workers), step, model=step.model,
                                  optimizer=step.optimizer, batch_sizes=(BATCH,),
                                  workers=(workers,), warmup_steps=1, steps=3,
                                  loader_options=False, confirm=False, progress=False)
                finally:
                    pace._wrapped.clear()
                ok = [t for t in result.trials if t.ok]
                paced[arm] += [t.data_wait_pct or 0.0 for t in ok
                               if t.data_wait_by == "loader pace"]
                per_batch[arm] += [t.loader_batch_s for t in ok if t.loader_batch_s is not None]
        for arm in ARMS:
            waits = ", ".join(f"{w:.1f} %" for w in paced[arm]) or "-"
            read = sorted(per_batch[arm])
            median = f"{1000 * read[len(read) // 2]:.1f} ms" if read else "-"
            rows.append(f"| {workers} | {arm} | {repeat} | {len(paced[arm])} | {waits} "
                        f"| {median} |")
    return rows


class Lumpy(SlowSamples):
    """20 ms a batch, one batch in ten (by its first index) 150 ms: 33 ms on average."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        time.sleep(0.15 if random.Random(indices[0]).random() < 0.1 else 0.02)
        return [(self.x[i], self.y[i]) for i in indices]


def lumpy(repeat: int) -> list[str]:
    """Case 3: one worker whose batches take 20 ms, one in ten 150 ms (33 ms on average),
    against 50 ms steps: it keeps up on average. A long window (150 steps) says what the
    steady wait is; each short one (3 steps) holds a few batches, and one slow batch among
    them must not set the pace."""

    def trial(steps: int, seed: int) -> Trial:
        step = Step(0.05, seed=seed)
        sampler = torch.utils.data.RandomSampler(
            range(100_000), generator=torch.Generator().manual_seed(seed))
        data = DataLoader(Lumpy(n=100_000), batch_size=BATCH, num_workers=1,
                          collate_fn=collate_numpy, sampler=sampler)
        result = tune(data, step, model=step.model, optimizer=step.optimizer,
                      batch_sizes=(BATCH,), workers=(1,), warmup_steps=1, steps=steps,
                      loader_options=False, confirm=False, progress=False)
        (ran,) = [t for t in result.trials if t.ok]
        return ran

    def said(t: Trial) -> str:
        per_batch = "-" if t.loader_batch_s is None else f"{1000 * t.loader_batch_s:.0f} ms"
        return f"{t.data_wait_pct or 0.0:.1f} % ({t.data_wait_by}, {per_batch} a batch)"

    long = trial(150, 10_000)
    short = [trial(3, seed) for seed in range(repeat)]
    paced = [t for t in short if t.data_wait_by == "loader pace"]
    waits = sorted(t.data_wait_pct or 0.0 for t in short)
    spread = f"{waits[len(waits) // 2]:.1f} % ({waits[0]:.1f}-{waits[-1]:.1f})"
    rows = ["| window | trials | every wait, median (range) | read `loader pace` "
            "| their waits (time per batch) |", "|---|---|---|---|---|",
            f"| 150 steps | 1 | {long.data_wait_pct or 0.0:.1f} % "
            f"| {int(long.data_wait_by == 'loader pace')} | {said(long)} |",
            f"| 3 steps | {repeat} | {spread} | {len(paced)} "
            f"| {', '.join(map(said, paced)) or '-'} |"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=12, help="trials a worker count in case 2")
    args = ap.parse_args(argv)
    text = "\n".join(["## 1. just short of the 5 % target (100 ms step, 10 timed steps)", "",
                      *near_target(), "",
                      "## 2. a loader that keeps up (10 ms a batch), steps of 25-75 ms, 3 timed "
                      "steps", "", *jittery(args.repeat), "",
                      "## 3. a lumpy loader that keeps up on average (20 ms a batch, one in ten "
                      "150 ms), 50 ms steps", "", *lumpy(args.repeat), ""])
    args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
