"""Does a nicer engine process spare a training loop on busy CPUs the cost of its start?
(issue 18)

On an H200 host, the steps 0.8-2 s after a ``Monitor`` with a W&B sink started beside the
user's own W&B run were up to 14 ms slower, and in them the training thread waited 6-9 ms a step
for a CPU while the engine process burned CPU (``import wandb``, the attach to the user's run):
``benchmarks/results/2026-11-29-h200-start-aftereffect``, ``c3`` and ``c4``.
``GPULENS_ENGINE_NICE=N`` runs the engine process N nicer than training (default 0). This
measures what 10 does on a host whose CPUs the training keeps busy: a loop of float32 matrix
products on every CPU (``torch.set_num_threads(os.cpu_count())``, sized for ``--step-ms``),
logging its loss to its own offline W&B run every step, as a Hugging Face ``Trainer`` with
``report_to="wandb"``
does. Each block runs ``--burn`` steps, then the arm's start, then ``--steps`` counted steps
with ``Monitor.log`` after each, then ``stop()``. Arms (every arm once a round, balanced
seeded order):

``off``       no monitor
``off_b``     no monitor either (the A/A arm: the noise a difference must clear)
``nice0``     ``Monitor(sinks=["jsonl", "wandb"])`` (its W&B sink attaches to the loop's run)
              with ``GPULENS_ENGINE_NICE=0``: the engine as nice as training (the default)
``nice10``    the same with ``GPULENS_ENGINE_NICE=10``

Each block's value is the mean of its counted steps (wall time), read in percentage points of
the same round's ``off`` (``paired.py``); each arm's step by position after the start is
printed too. GPUs are simulated (``GPULENS_BACKEND=simulated`` unless set): the question is
the host's CPUs.

    python benchmarks/engine_priority.py --budget-s 240 --json out.json --md out.md
    python benchmarks/engine_priority.py --quick          # a smoke run (2 short rounds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired

ARMS = ("off", "off_b", "nice0", "nice10")
PROCS = ("training", "engine", "wandb-core")


class Loop:
    """The CPU-bound training loop and its W&B run."""

    def __init__(self, step_ms: float, tmp: Path) -> None:
        import torch
        import wandb

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        n = 256
        self.a = torch.randn(n, n)
        self.b = torch.randn(n, n)
        one = self._time(self._product, 5)
        self.repeat = max(1, round(step_ms / 1e3 / one))
        self.run: Any = wandb.init(mode="offline", project="engine-priority",
                                   dir=os.environ.get("WANDB_DIR") or str(tmp),
                                   settings=wandb.Settings(x_stats_sampling_interval=15.0))

    def _product(self) -> float:
        return float((self.a @ self.b).sum())

    @staticmethod
    def _time(fn: Any, n: int) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    def step(self) -> float:
        """One step: ``repeat`` products, the loss logged to the loop's W&B run."""
        loss = 0.0
        for _ in range(self.repeat):
            loss = self._product()
        self.run.log({"user/loss": loss})
        return loss


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of this process and of each child process (recursive) by name
    (``engine`` for gpulens's, else the executable's name: ``wandb-core`` ...)."""
    import psutil

    me = psutil.Process()
    times = me.cpu_times()
    out = {"training": times.user + times.system}
    for child in me.children(recursive=True):
        try:
            name = child.name()
            if name.startswith("python") and "gpulens" in " ".join(child.cmdline()):
                name = "engine"
            times = child.cpu_times()
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + times.user + times.system
    return out


def block(loop: Loop, arm: str, args: argparse.Namespace, tmp: Path, first: int,
          cpu: dict[str, list[dict[str, float]]], nice: dict[str, list[int]]
          ) -> tuple[list[float], list[float]]:
    """Wall seconds of the burn-in steps and of the counted steps after the arm's start;
    appends to ``cpu[arm]`` the CPU seconds a second of each process in the counted steps'
    second half (the steady state), and to ``nice[arm]`` how much nicer than this process
    its engine ran."""
    import psutil

    import gpulens

    burn = []
    for _ in range(args.burn):
        t0 = time.perf_counter()
        loop.step()
        burn.append(time.perf_counter() - t0)
    mon = None
    if not arm.startswith("off"):
        os.environ["GPULENS_ENGINE_NICE"] = "0" if arm == "nice0" else "10"
        mon = gpulens.Monitor(interval=0.1,
                              sinks=[f"jsonl:{tmp / f'{arm}-{first}.jsonl'}", "wandb"])
        mon.start()
        engine = mon._transport.pid  # type: ignore[union-attr]
        nice[arm].append(psutil.Process(engine).nice() - os.getpriority(os.PRIO_PROCESS, 0))
    counted = []
    half: tuple[float, dict[str, float]] | None = None
    for i in range(args.steps):
        if i == args.steps // 2:
            half = (time.perf_counter(), cpu_by_process())
        t0 = time.perf_counter()
        loss = loop.step()
        if mon is not None:
            mon.log(first + i, loss=loss)
        counted.append(time.perf_counter() - t0)
    if half is not None:
        wall, end = time.perf_counter() - half[0], cpu_by_process()
        cpu[arm].append({k: (v - half[1].get(k, 0.0)) / wall for k, v in end.items()
                         if k in half[1]})
    if mon is not None:
        mon.stop()
    return burn, counted


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--step-ms", type=float, default=50.0, help="the step to size the loop for")
    p.add_argument("--burn", type=int, default=6)
    p.add_argument("--steps", type=int, default=40, help="counted steps after the start")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--max-rounds", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 short rounds")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds, args.step_ms = 2, 6, 2, 10.0
    os.environ.setdefault("GPULENS_BACKEND", "simulated")
    os.environ.setdefault("WANDB_SILENT", "true")
    tmp = Path(tempfile.mkdtemp(prefix="engine-priority-"))
    loop = Loop(args.step_ms, tmp)
    values: dict[str, dict[int, float]] = {a: {} for a in ARMS}
    profile: dict[str, list[list[float]]] = {a: [] for a in ARMS}
    cpu: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    nice: dict[str, list[int]] = {a: [] for a in ARMS if not a.startswith("off")}
    t_end, rounds, first = time.monotonic() + args.budget_s, 0, 0
    while rounds < args.max_rounds and (rounds < 2 or time.monotonic() < t_end):
        for arm in paired.round_order(list(ARMS), args.seed, rounds):
            burn, counted = block(loop, arm, args, tmp, first, cpu, nice)
            first += args.steps
            values[arm][rounds] = statistics.fmean(counted)
            base = statistics.median(burn)
            profile[arm].append([1e3 * (c - base) for c in counted])
        rounds += 1
        print(f"round {rounds}: " + ", ".join(
            f"{a} {1e3 * values[a][rounds - 1]:.1f} ms" for a in ARMS), file=sys.stderr)
    loop.run.finish()
    comps = paired.compare(values, dict.fromkeys(ARMS, "off"), rivals=[("nice10", "nice0")],
                           seed=args.seed)
    n = args.steps
    lines = [f"## A monitor's start on a loop that keeps every CPU busy ({os.cpu_count()} CPUs)",
             f"{loop.repeat} products of 256x256 a step (~{args.step_ms:g} ms), the loss to "
             f"the loop's own W&B run every step; {rounds} rounds of {args.burn} steps, the "
             f"arm's start, {n} counted steps", "",
             paired.table(comps), "",
             "each counted step less its block's burn-in median (ms, mean of rounds)", "",
             "| arm | " + " | ".join(str(i) for i in range(n)) + " | sum |",
             "|---|" + "---|" * (n + 1)]
    for arm in ARMS:
        means = [statistics.fmean(b[i] for b in profile[arm]) for i in range(n)]
        lines.append(f"| {arm} | " + " | ".join(f"{m:+.1f}" for m in means)
                     + f" | {sum(means):+.0f} |")
    lines += ["", "CPUs busy in the counted steps' second half (CPU seconds a second, mean of "
              "rounds), by process", "", "| arm | " + " | ".join(PROCS) + " |",
              "|---|" + "---|" * len(PROCS)]
    for arm in ARMS:
        lines.append(f"| {arm} | " + " | ".join(
            f"{statistics.fmean(c.get(k, 0.0) for c in cpu[arm]):.2f}" if cpu[arm] else "-"
            for k in PROCS) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({
            "values": values, "profile_ms": profile, "cpu_s_per_s": cpu, "rounds": rounds,
            "args": vars(args),
            "repeat": loop.repeat, "cpus": os.cpu_count(), "engine_nice": nice,
            "comparisons": [c.as_dict() for c in comps]}, indent=1, default=str))


if __name__ == "__main__":
    main()
