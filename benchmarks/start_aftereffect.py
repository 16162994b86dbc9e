"""What does a monitor's start do to the training steps that follow it? (issue 18)

The HF every-step runs on one H200 (``results/2026-11-29-h200-hf-ls1-always-call``,
``slow_steps.md``) had most of the gpulens arm's slow steps among a block's first three,
0.6-0.9 s after the monitor started, +5 to +19 ms each, mostly on the GPU's busy time. This
harness starts the monitor (or a part of what its engine does) in the middle of a plain loop
that syncs every step (``loss.item()``, the GPT-2-small-sized model of ``overhead_gpu.py``) and
times each step around it on the GPU's timeline, so the after-effect shows by position, and its
cause by which arm has it.

Each block runs ``--burn`` steps, then the arm's start (on the training thread, outside any
step's time: the stamps are made again after it), then ``--steps`` counted steps with the arm's
per-step work, then its stop. Arms (every arm once a round, balanced seeded order):

``off``, ``off_b``  nothing starts (the A/A pair)
``nvml``           a new process opens NVML through gpulens's own source and reads the fast
                   fields every ``--interval`` (the engine's sampler without GPM or the rest)
``gpm``            a new process opens NVML and takes a GPM sample every ``--interval`` / 2
                   (at least 50 ms), as the engine does
``mon``            ``gpulens.Monitor(interval=--interval, sinks=[jsonl])``, ``log(step,
                   loss=...)`` after every step, ``stop()`` after the block
``mon_nogpm``      ``mon`` with ``gpm=False``
``mon_wandb``      ``mon`` with a W&B sink too (an offline run of the engine's own; skipped
                   when wandb is not installed)

A block's value is the mean of its counted steps, read in percentage points of the same
round's ``off`` (``paired.py``). Also printed: each arm's step by position in its block, less
``off``'s, and the seconds from the arm's start to the end of each counted step (mean of
rounds), to line a slow position up with what the engine does then.

    python benchmarks/start_aftereffect.py --budget-s 300 --json $OUT/aftereffect.json \\
        --md $OUT/aftereffect.md
    GPULENS_BACKEND=simulated python benchmarks/start_aftereffect.py --quick   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop_rounds as lr
import overhead_gpu as og
import paired

ARMS = ("off", "off_b", "nvml", "gpm", "mon", "mon_nogpm", "mon_wandb")

READER = """
import sys, time
from gpulens.sources.nvml import NvmlSource
from gpulens.sources.simulated import SimulatedNVML
kind, index, period, simulated = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
src = NvmlSource(SimulatedNVML(1) if simulated == "1" else None)
src.open()
dev = src.device(index)
read = dev.read_gpm if kind == "gpm" else dev.read_fast
while True:
    read()
    print("read", flush=True)
    time.sleep(period)
"""


class Started:
    """What an arm started: ``log`` after each counted step, ``stop`` after the block."""

    def __init__(self, log: Callable[[int, float], None], stop: Callable[[], int | None]) -> None:
        self.log, self.stop = log, stop
        """``stop()``: the reads a reader process made (``None`` for a monitor)."""


def _nothing(step: int, loss: float) -> None:
    del step, loss


def _reader(kind: str, index: int, interval: float, simulated: bool) -> Started:
    period = interval if kind == "nvml" else max(0.05, interval / 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, kind, str(index), str(period), "1" if simulated else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop() -> int:
        """After the block (outside its timing): wait for the reader's first read (its
        start may outlast a short block), end it; the reads it made."""
        assert proc.stdout is not None
        first = proc.stdout.readline()
        proc.terminate()
        rest = proc.communicate(timeout=10)[0]
        return (first + rest).count("read")

    return Started(_nothing, stop)


def _monitor(arm: str, out: Path, step: int, interval: float) -> Started:
    import gpulens

    sinks = [f"jsonl:{out / f'{arm}-{step}.jsonl'}"]
    if arm == "mon_wandb":
        sinks.append("wandb")
    mon = gpulens.Monitor(interval=interval, sinks=sinks, gpm=arm != "mon_nogpm")
    mon.start()
    def stop() -> None:
        mon.stop()

    return Started(lambda s, loss: mon.log(s, loss=loss), stop)


def start_arm(arm: str, out: Path, step: int, args: argparse.Namespace, index: int,
              simulated: bool) -> Started | None:
    """Start ``arm`` (``None``: nothing to start)."""
    if arm.startswith("off"):
        return None
    if arm in ("nvml", "gpm"):
        return _reader(arm, index, args.interval, simulated)
    return _monitor(arm, out, step, args.interval)


class Block:
    """One block of an arm; keeps each counted step's seconds since the arm's start."""

    def __init__(self, s: og.Setup, args: argparse.Namespace, out: Path, index: int,
                 simulated: bool) -> None:
        self.s, self.args, self.out, self.index, self.simulated = s, args, out, index, simulated
        self.since_start: dict[str, list[list[float]]] = {}
        self.start_s: dict[str, list[float]] = {}
        self.reads: dict[str, list[int]] = {}
        """Per reader arm, the reads its process made in each block."""

    def __call__(self, arm: str, first: int) -> list[float]:
        s, args = self.s, self.args
        clock = lr.StepClock(s)
        clock.stamp()
        for i in range(args.burn):
            og.train_step(s, first + i)
            clock.stamp()
        before = clock.times()
        t0 = time.perf_counter()
        started = start_arm(arm, self.out, first + args.burn, args, self.index, self.simulated)
        self.start_s.setdefault(arm, []).append(time.perf_counter() - t0)
        clock = lr.StepClock(s)
        clock.stamp()
        ends = []
        for i in range(args.steps):
            step = first + args.burn + i
            loss = og.train_step(s, step)
            if started is not None:
                started.log(step, loss)
            clock.stamp()
            ends.append(time.perf_counter() - t0)
        after = clock.times()
        if started is not None:
            reads = started.stop()
            if reads is not None:
                self.reads.setdefault(arm, []).append(reads)
        self.since_start.setdefault(arm, []).append(ends)
        return before + after

    def since_table(self) -> list[str]:
        """Seconds from each arm's start to the end of each counted step (mean of rounds)."""
        n = self.args.steps
        out = ["seconds from the arm's start to the end of each counted step (mean of rounds; "
               "the monitor's start() itself, on the training thread, is in the first)", "",
               "| arm | start() s | " + " | ".join(str(i) for i in range(n)) + " |",
               "|---|---|" + "---|" * n]
        for arm, blocks in self.since_start.items():
            means = [sum(b[i] for b in blocks) / len(blocks) for i in range(n)]
            start = sum(self.start_s[arm]) / len(self.start_s[arm])
            out.append(f"| {arm} | {start:.3f} | " + " | ".join(f"{v:.2f}" for v in means)
                       + " |")
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    lr.add_args(p, burn=8, max_rounds=300)
    p.set_defaults(steps=24)
    p.add_argument("--interval", type=float, default=0.1, help="the monitor's interval")
    p.add_argument("--arms", default=",".join(ARMS), help="a subset, off first")
    p.add_argument("--records", type=Path, default=None,
                   help="the monitors' JSONL records and W&B runs (default: a new temp folder)")
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds = 2, 4, 2
    arms = [a for a in args.arms.split(",") if a]
    if not arms or arms[0] != "off" or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: a subset of {ARMS}, off first")
    skipped = []
    if "mon_wandb" in arms and importlib.util.find_spec("wandb") is None:
        arms.remove("mon_wandb")
        skipped.append("mon_wandb (wandb is not installed)")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    s = og.setup(args.quick, args.target_ms, None, None)
    cuda = s.device.type == "cuda"
    index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]) if cuda else 0
    tmp = args.records or Path(tempfile.mkdtemp(prefix="start-aftereffect-"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", str(tmp))
    block = Block(s, args, tmp, index, simulated=not cuda)
    rounds = lr.Rounds(tuple(arms))
    def extra() -> dict[str, Any]:
        return {"since_start_s": block.since_start, "start_s": block.start_s,
                "reads": block.reads, "skipped": skipped}

    rounds.run(args, block, extra)
    hw = og.hardware(s)
    lines = [f"## Steps around a monitor's start, on a plain loop that syncs every step "
             f"({hw.get('gpu', hw['device'])})",
             f"model {s.n_params / 1e6:.1f}M params, batch {s.batch_size} x {s.seq_len}; "
             f"{rounds.rounds} rounds of {args.burn} steps, the arm's start, {args.steps} "
             f"counted steps; interval {args.interval:g} s"
             + (f"; skipped: {', '.join(skipped)}" if skipped else ""), "",
             paired.table(rounds.comparisons("off", args.seed), 0.3), "",
             *rounds.profile_table("off", args.burn), "", *block.since_table(), "",
             "reads a reader process made a block (its first may come after the block): "
             + "; ".join(f"{arm} {min(n)}-{max(n)}" for arm, n in block.reads.items())]
    lr.write(args, lines, rounds, "off", extra(), s)


if __name__ == "__main__":
    main()
