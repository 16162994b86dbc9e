"""Do gpulens's NVML reads, made from another process, slow a training step? (issue 18)

A dose-response test of each kind of read the engine makes, on a step that syncs every step
(``loss.item()``, as a Hugging Face ``Trainer`` logging every step does). One training process
runs the GPT-2-small-sized loop of ``overhead_gpu.py`` (batch chosen for ``--target-ms``); a
reader process (spawned, the way the engine is) makes NVML reads through gpulens's own
``NvmlDevice`` on the same GPU, one kind at a time, at a fixed rate. Arms:

``idle``, ``idle_b``  the reader makes no read (the A/A pair)
``fast@R``           ``read_fast()``: utilization, memory, power, limit, temperature, clocks,
                     clock-event reasons (the engine: every ``interval``)
``samples@R``        ``read_samples`` of power and of utilization (the driver's buffers; the
                     engine: once a second, and per waiting step mark at most every 0.2 s)
``energy@R``         ``read_energy_mj`` (the total-energy counter; the engine: once a second)
``gpm@R``            ``read_gpm`` (a GPM sample and its metrics; the engine: every
                     ``interval / 2``, at least every 50 ms)
``engine``           all of them at the engine's rates for ``--interval`` and one mark a step

``R`` is the rate in reads a second (``--rate``, default 50, far above the engine's, so an
effect that exists shows). Per round every arm runs once, in a balanced, seeded order, as a
block of ``--burn`` + ``--steps`` steps; the reader is switched before the block's burn-in
steps. Each step is timed on the GPU's timeline (an event at each step's end). A block's value
is the mean of its measured steps; each arm is read in percentage points of the same round's
``idle`` (``paired.py``: mean and 95 % bootstrap interval, beside the A/A arm). The reader
also reports what each read took (median and 90th percentile, ms): with the effect per
second of reading, that gives the cost of the engine's actual rate.

One reader process serves the whole run by default, and it reads every kind once at its start,
so a cost of a read being *in use at all* (GPM's, say) would sit in the idle arms too and
cancel. ``--fresh-reader`` starts a reader of its own for every block, before its burn-in, that
touches only its arm's kinds, and ends it after the block: that kind of cost then shows.

    python benchmarks/nvml_interference.py --budget-s 300 --json $OUT/nvml_interference.json
    python benchmarks/nvml_interference.py --fresh-reader --rate 4 --budget-s 300
    python benchmarks/nvml_interference.py --quick          # a smoke run on a CPU (no reads)

Prints Markdown (``--md`` writes it too).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop_rounds as lr
import overhead_gpu as og
import paired


def _reads(dev: Any, kind: str) -> Callable[[], object]:
    from gpulens.sources.nvml import POWER_SAMPLES, UTIL_SAMPLES

    if kind == "fast":
        return lambda: dev.read_fast()
    if kind == "samples":
        return lambda: (dev.read_samples(POWER_SAMPLES), dev.read_samples(UTIL_SAMPLES))
    if kind == "energy":
        return dev.read_energy_mj
    if kind == "gpm":
        return dev.read_gpm
    raise ValueError(kind)


def engine_plan(interval: float, step_s: float) -> list[tuple[str, float]]:
    """(kind, reads a second) of the engine's sampler at ``interval`` with one step mark per
    ``step_s`` (see ``gpulens.engine.sampler``)."""
    samples = 1.0 + min(1.0 / max(step_s, 1e-3), 1 / 0.2)  # slow pass + early reads per mark
    return [("fast", 1.0 / interval), ("gpm", 1.0 / max(0.05, interval / 2)),
            ("energy", 1.0), ("samples", samples)]


KINDS = ("fast", "samples", "energy", "gpm")


def kinds_of(arm: str) -> tuple[str, ...]:
    """The kinds of read an arm makes (``idle``: none; ``engine``: all)."""
    kind = arm.split("@")[0]
    if kind.startswith("idle"):
        return ()
    return KINDS if kind == "engine" else (kind,)


def reader(conn: Any, nvml_index: int, rate: float, interval: float, step_s: float,
           simulated: bool = False, prime: tuple[str, ...] = KINDS) -> None:
    """The reader process: waits for an arm name, reads at its rate until the next one
    (``simulated``: against gpulens's simulated NVML, for a smoke run on a CPU). ``prime``:
    the kinds read once at the start (GPM's first sample, the buffers' start); with
    ``--fresh-reader`` only the block's own, so an idle block's reader never touched GPM."""
    from gpulens.sources.nvml import NvmlSource
    from gpulens.sources.simulated import SimulatedNVML

    src = NvmlSource(SimulatedNVML(1) if simulated else None)
    src.open()
    dev = src.device(nvml_index)
    for kind in prime:
        _reads(dev, kind)()
    arm = "idle"
    durations: dict[str, list[float]] = {}
    plan: list[tuple[Callable[[], object], float, str]] = []
    due: list[float] = []
    while True:
        wait = max(0.0, min(due) - time.monotonic()) if due else None
        if conn.poll(wait):
            msg = conn.recv()
            if msg == "quit":
                conn.send(durations)
                src.close()
                return
            arm = msg
            kind = arm.split("@")[0]
            if kind.startswith("idle"):
                plan = []
            elif kind == "engine":
                plan = [(_reads(dev, k), r, k) for k, r in engine_plan(interval, step_s)]
            else:
                plan = [(_reads(dev, kind), rate, kind)]
            now = time.monotonic()
            due = [now + random.random() / r for _, r, _ in plan]
            conn.send("ok")
            continue
        now = time.monotonic()
        for i, (fn, r, kind) in enumerate(plan):
            if now >= due[i]:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if not arm.startswith("engine"):
                    durations.setdefault(kind, []).append(dt)
                due[i] = max(due[i] + 1.0 / r, time.monotonic())


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"n": len(v), "median_ms": 1e3 * statistics.median(v),
            "p90_ms": 1e3 * v[int(0.9 * (len(v) - 1))], "max_ms": 1e3 * v[-1]}


def block(s: og.Setup, steps: int, start: int) -> list[float]:
    """Seconds of each of ``steps`` steps, on the GPU timeline."""
    clock = lr.StepClock(s)
    clock.stamp()
    for i in range(steps):
        og.train_step(s, start + i)
        clock.stamp()
    return clock.times()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    lr.add_args(p, burn=3, max_rounds=200)
    p.add_argument("--rate", type=float, default=50.0, help="reads a second of each kind")
    p.add_argument("--interval", type=float, default=0.1, help="the engine arm's interval")
    p.add_argument("--fresh-reader", action="store_true",
                   help="a reader process of its own for every block, started before its "
                   "burn-in and ended after it, that reads only its arm's kinds: a cost of "
                   "GPM (or another read) being in use at all, not of each read, then shows "
                   "against the idle arms (one reader for the whole run cannot show it)")
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds = 1, 3, 2
    s = og.setup(args.quick, args.target_ms, None, None)
    step_s = statistics.fmean(block(s, 6, 0)[1:])
    rate = f"@{args.rate:g}"
    arms = ["idle", "idle_b", "fast" + rate, "samples" + rate, "energy" + rate, "gpm" + rate,
            "engine"]
    cuda = s.device.type == "cuda"
    index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]) if cuda else 0
    durations: dict[str, list[float]] = {}

    def start_reader(prime: tuple[str, ...]) -> tuple[Any, Any]:
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=reader, args=(child, index, args.rate, args.interval, step_s, not cuda,
                                 prime), daemon=True)
        proc.start()
        return parent, proc

    def end_reader(parent: Any, proc: Any) -> None:
        parent.send("quit")
        for kind, values in parent.recv().items():
            durations.setdefault(kind, []).extend(values)
        proc.join(10)

    shared = None if args.fresh_reader else start_reader(KINDS)

    def run_block(arm: str, step: int) -> list[float]:
        one = shared or start_reader(kinds_of(arm))
        one[0].send(arm)  # the reader switches (or starts) before the block's burn-in
        assert one[0].recv() == "ok"
        try:
            return block(s, args.burn + args.steps, step)
        finally:
            if shared is None:
                end_reader(*one)

    rounds = lr.Rounds(arms)
    rounds.run(args, run_block)
    if shared is not None:
        end_reader(*shared)
    stats = {k: _stats(v) for k, v in durations.items()}
    plan = engine_plan(args.interval, step_s)
    lines = [f"## NVML reads from another process against a step that syncs every step "
             f"({og.hardware(s).get('gpu', s.device)})",
             f"model {s.n_params / 1e6:.1f}M params, batch {s.batch_size} x {s.seq_len}; "
             f"step {step_s * 1e3:.1f} ms; {rounds.rounds} rounds of {args.burn} + "
             f"{args.steps} steps an arm; reads at {args.rate:g}/s (`engine`: {plan}); "
             + ("a fresh reader process for every block, touching only its arm's reads"
                if args.fresh_reader else "one reader process for the whole run"),
             "", paired.table(rounds.comparisons("idle", args.seed)), "",
             "| read | calls | median ms | p90 ms | max ms |", "|---|---|---|---|---|"]
    for kind, st in stats.items():
        lines.append(f"| {kind} | {st['n']} | {st['median_ms']:.3f} | {st['p90_ms']:.3f} | "
                     f"{st['max_ms']:.3f} |")
    lr.write(args, lines, rounds, "idle",
             {"durations": stats, "step_s": step_s, "engine_plan": plan,
              "fresh_reader": args.fresh_reader}, s)


if __name__ == "__main__":
    main()
