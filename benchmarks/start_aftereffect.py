"""What does a monitor's start do to the training steps that follow it? (issue 18)

The HF every-step runs on one H200 (``results/2026-11-29-h200-hf-ls1-always-call``,
``slow_steps.md``) had most of the gpulens arm's slow steps among a block's first three,
0.6-0.9 s after the monitor started, +5 to +19 ms each, mostly on the GPU's busy time. This
harness starts the monitor (or a part of what its engine does) in the middle of a plain loop
that syncs every step (``loss.item()``, the GPT-2-small-sized model of ``overhead_gpu.py``, an
all-ones attention mask) and
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
``mon_wandb_nice10`` ``mon_wandb`` with ``GPULENS_ENGINE_NICE=10``: the engine process 10
                   nicer than training (the default is as nice)
``mon_wandb_blas`` ``mon_wandb`` with the engine's BLAS and OpenMP threads as the training
                   process's environment has them (before ``spawn.ENGINE_ONE_THREAD``: NumPy's
                   OpenBLAS, imported with wandb, started a spinning thread per CPU)
``sess``           what the Hugging Face callback runs a step, on this loop: a
                   ``TrainingSession`` over ``mon``'s monitor with the step marks
                   (``StepPhases``, CUDA events) and the token counter (``TokenCounter``, a
                   forward pre-hook on an all-ones mask), each row written at the next step's
                   optimizer mark (``later=True``), as ``session_parts.py``'s ``later`` arm
``sess_phases``    ``sess`` without the token counter
``sess_tokens``    ``sess`` without the step marks

``--user-wandb``: the loop has a W&B run of its own (offline, made once before the rounds, as
``paths_aa.py``'s HF paths have through ``report_to=["wandb"]``) and logs the loss to it after
every step in every arm; the ``mon_wandb`` arm's sink then attaches to that run from the engine
process, as the HF path's merged sink does, instead of starting one of its own.

``--probe``: after each counted step, also where the host's CPU went in it: the training
thread's run and run-queue wait (``/proc/self/task/<tid>/schedstat``), the training process's
other threads (W&B's, gpulens's), and each child process by name (the engine, ``wandb-core``);
each step over its block's median by more than 4 ms is listed with those figures.

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
import statistics
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

ARMS = ("off", "off_b", "nvml", "gpm", "mon", "mon_nogpm", "mon_wandb", "mon_wandb_nice10",
        "mon_wandb_blas", "sess", "sess_phases", "sess_tokens")
SESSIONS = ("sess", "sess_phases", "sess_tokens")

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
    print("read", time.monotonic(), flush=True)
    time.sleep(period)
"""


def train_step(s: Any, step: int) -> float:
    """One step of the loop, every arm's (``overhead_gpu.train_step`` with the all-ones
    mask the sessions' token counter reads); the loss as a float (a sync), logged to the
    loop's own W&B run as ``user/loss`` if it has one (``--user-wandb``)."""
    x = s.batches[step % len(s.batches)]
    loss = s.model(input_ids=x, attention_mask=s.masks[step % len(s.masks)], labels=x).loss
    loss.backward()
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    value = float(loss.item())
    if s.user_run is not None:
        s.user_run.log({"user/loss": value})
    return value


class Started:
    """What an arm started: ``train(step)`` runs one counted step with the arm's per-step
    work, ``stop()`` ends it after the block and returns, for a reader process, the
    ``time.monotonic()`` of each read it made (the system's clock: the same in every process)."""

    def __init__(self, train: Callable[[int], object], stop: Callable[[], list[float] | None]
                 ) -> None:
        self.train, self.stop = train, stop


def _reader(s: og.Setup, kind: str, index: int, interval: float, simulated: bool) -> Started:
    period = interval if kind == "nvml" else max(0.05, interval / 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, kind, str(index), str(period), "1" if simulated else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop() -> list[float]:
        """After the block (outside its timing): wait for the reader's first read (its
        start may outlast a short block), end it; the times of its reads."""
        assert proc.stdout is not None
        first = proc.stdout.readline()
        proc.terminate()
        rest, err = proc.communicate(timeout=10)
        if err.strip():
            s.reader_errors.append(f"{kind}: {err.strip().splitlines()[-1]}")
        return [float(line.split()[1]) for line in (first + rest).splitlines()
                if line.startswith("read ")]

    return Started(lambda step: train_step(s, step), stop)


def _monitor(s: og.Setup, arm: str, out: Path, step: int, interval: float) -> Started:
    import gpulens

    sinks = [f"jsonl:{out / f'{arm}-{step}.jsonl'}"]
    if arm.startswith("mon_wandb"):
        sinks.append("wandb")
    mon = gpulens.Monitor(interval=interval, sinks=sinks, gpm=arm != "mon_nogpm")
    from gpulens.transport import spawn

    nice = os.environ.pop("GPULENS_ENGINE_NICE", None)
    one_thread = spawn.ENGINE_ONE_THREAD
    if arm == "mon_wandb_nice10":
        os.environ["GPULENS_ENGINE_NICE"] = "10"
    if arm == "mon_wandb_blas":
        spawn.ENGINE_ONE_THREAD = {}
    try:
        mon.start()
    finally:
        spawn.ENGINE_ONE_THREAD = one_thread
        os.environ.pop("GPULENS_ENGINE_NICE", None)
        if nice is not None:
            os.environ["GPULENS_ENGINE_NICE"] = nice

    def train(step: int) -> None:
        mon.log(step, loss=train_step(s, step))

    def stop() -> None:
        mon.stop()

    return Started(train, stop)


def _session(s: Any, arm: str, out: Path, step: int, interval: float) -> Started:
    """The HF callback's per-step work on this loop (``session_parts.py``'s ``later`` arm)."""
    import gpulens
    from gpulens.integrations.phases import StepPhases
    from gpulens.integrations.session import TrainingSession
    from gpulens.work.hf import TokenCounter, model_flops

    mon = gpulens.Monitor(interval=interval, sinks=[f"jsonl:{out / f'{arm}-{step}.jsonl'}"])
    phases = StepPhases() if arm in ("sess", "sess_phases") else None
    work = TokenCounter(model_flops(s.model)).attach(s.model) \
        if arm in ("sess", "sess_tokens") else None
    session = TrainingSession(mon, start_step=step - 1, steps_done=step - 1, phases=phases,
                              work=work).start()

    def train(step: int) -> None:
        x = s.batches[step % len(s.batches)]
        session.resume()
        session.step_begin()
        loss = s.model(input_ids=x, attention_mask=s.masks[step % len(s.masks)], labels=x).loss
        loss.backward()
        session.before_optimizer()
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        session.step_end()
        value = float(loss.item())
        if s.user_run is not None:
            s.user_run.log({"user/loss": value})
        session.row(step, step, {"loss": value}, later=True)

    def stop() -> None:
        session.stop()
        if work is not None:
            work.detach()

    return Started(train, stop)


def start_arm(arm: str, s: og.Setup, out: Path, step: int, args: argparse.Namespace,
              index: int, simulated: bool) -> Started | None:
    """Start ``arm`` (``None``: nothing to start)."""
    if arm.startswith("off"):
        return None
    if arm in ("nvml", "gpm"):
        return _reader(s, arm, index, args.interval, simulated)
    if arm in SESSIONS:
        return _session(s, arm, out, step, args.interval)
    return _monitor(s, arm, out, step, args.interval)


def _schedstat(tid: int) -> tuple[float, float]:
    """(run, run-queue wait) seconds of a thread of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run) / 1e9, int(wait) / 1e9


def probe() -> dict[str, float]:
    """Cumulative CPU seconds: the training thread's run and wait, the process's other
    threads, and each child process (recursive) by name."""
    import threading

    import psutil

    main = threading.main_thread().native_id or -1
    out = {"train_run": 0.0, "train_wait": 0.0, "other_threads": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            run, wait = _schedstat(int(tid))
        except (OSError, ValueError):
            continue
        if int(tid) == main:
            out["train_run"], out["train_wait"] = run, wait
        else:
            out["other_threads"] += run
    for child in psutil.Process().children(recursive=True):
        try:
            name = og._child_name(child)
            times = child.cpu_times()
            out[f"child:{name}"] = out.get(f"child:{name}", 0.0) + times.user + times.system
        except psutil.Error:
            continue
    return out


class Block:
    """One block of an arm; keeps each counted step's seconds since the arm's start."""

    def __init__(self, s: og.Setup, args: argparse.Namespace, out: Path, index: int,
                 simulated: bool) -> None:
        self.s, self.args, self.out, self.index, self.simulated = s, args, out, index, simulated
        self.since_start: dict[str, list[list[float]]] = {}
        self.start_s: dict[str, list[float]] = {}
        self.probes: dict[str, list[list[dict[str, float]]]] = {}
        """``--probe``: per arm and block, each counted step's CPU (ms, :func:`probe`'s
        differences), with its host seconds as ``step_ms``."""
        self.reads: dict[str, list[list[float]]] = {}
        """Per reader arm and block, the seconds from the arm's start to each read made."""

    def __call__(self, arm: str, first: int) -> list[float]:
        s, args = self.s, self.args
        clock = lr.StepClock(s)
        clock.stamp()
        for i in range(args.burn):
            train_step(s, first + i)
            clock.stamp()
        before = clock.times()
        t0, m0 = time.perf_counter(), time.monotonic()
        started = start_arm(arm, s, self.out, first + args.burn, args, self.index,
                            self.simulated)
        self.start_s.setdefault(arm, []).append(time.perf_counter() - t0)
        clock = lr.StepClock(s)
        clock.stamp()
        ends = []
        probes = []
        last = probe() if args.probe else {}
        for i in range(args.steps):
            step = first + args.burn + i
            if started is not None:
                started.train(step)
            else:
                train_step(s, step)
            clock.stamp()
            ends.append(time.perf_counter() - t0)
            if args.probe:
                now = probe()
                probes.append({k: 1e3 * (v - last.get(k, 0.0)) for k, v in now.items()})
                last = now
        if args.probe:
            for i, one in enumerate(probes):
                one["step_ms"] = 1e3 * (ends[i] - (ends[i - 1] if i else 0.0))
            self.probes.setdefault(arm, []).append(probes)
        after = clock.times()
        if started is not None:
            reads = started.stop()
            if reads is not None:
                self.reads.setdefault(arm, []).append([r - m0 for r in reads])
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


    def probe_lines(self) -> list[str]:
        """Each counted step over its block's median by more than 4 ms (host time), with
        where the CPU went in it, beside the arm's median step."""
        if not self.probes:
            return []
        out = ["steps over their block's median by > 4 ms (host time), and where the CPU went "
               "in them (ms); the arm's median step below each arm", "",
               "| arm | block | position | s after start | over (ms) | CPU (ms) |",
               "|---|---|---|---|---|---|"]
        for arm, blocks in self.probes.items():
            for b, steps in enumerate(blocks):
                median = statistics.median(p["step_ms"] for p in steps[1:])
                for i, one in enumerate(steps[1:], 1):
                    if one["step_ms"] - median > 4:
                        cpu = ", ".join(f"{k} {v:.1f}" for k, v in one.items()
                                        if k != "step_ms" and v >= 0.05)
                        out.append(f"| {arm} | {b} | {i} | {self.since_start[arm][b][i]:.2f} "
                                   f"| +{one['step_ms'] - median:.1f} | {cpu} |")
            keys = sorted({k for steps in blocks for one in steps for k in one})
            typical = {k: statistics.median(one.get(k, 0.0) for steps in blocks
                                            for one in steps[1:]) for k in keys}
            out.append(f"| {arm} | median | | | | " + ", ".join(
                f"{k} {v:.1f}" for k, v in typical.items() if v >= 0.05) + " |")
        return out

    def reads_lines(self) -> list[str]:
        """When each reader process read, against the block's end."""
        out = []
        for arm, blocks in self.reads.items():
            firsts = [b[0] for b in blocks if b]
            ends = [e[-1] for e in self.since_start[arm]]
            within = [sum(r <= end for r in b) for b, end in zip(blocks, ends, strict=True)]
            out.append(f"{arm}'s reader: first read {min(firsts):.2f}-{max(firsts):.2f} s after "
                       f"its start; {min(within)}-{max(within)} reads within a block "
                       f"(blocks end {min(ends):.2f}-{max(ends):.2f} s after the start)"
                       if firsts else f"{arm}'s reader: no read")
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    lr.add_args(p, burn=8, max_rounds=300)
    p.set_defaults(steps=24)
    p.add_argument("--interval", type=float, default=0.1, help="the monitor's interval")
    p.add_argument("--arms", default=",".join(ARMS), help="a subset, off first")
    p.add_argument("--probe", action="store_true",
                   help="where the host's CPU went in each counted step (see above)")
    p.add_argument("--user-wandb", action="store_true",
                   help="the loop logs to a W&B run of its own (see above)")
    p.add_argument("--records", type=Path, default=None,
                   help="the monitors' JSONL records and W&B runs (default: a new temp folder)")
    args = p.parse_args()
    if args.quick:
        args.burn, args.steps, args.max_rounds = 2, 4, 2
    arms = [a for a in args.arms.split(",") if a]
    if not arms or arms[0] != "off" or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: a subset of {ARMS}, off first")
    skipped = []
    if importlib.util.find_spec("wandb") is None:
        for arm in [a for a in arms if a.startswith("mon_wandb")]:
            arms.remove(arm)
            skipped.append(f"{arm} (wandb is not installed)")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    s: Any = og.setup(args.quick, args.target_ms, None, None)
    s.masks = [s.torch.ones_like(b) for b in s.batches]  # the sessions' token counter reads it
    s.reader_errors = []
    cuda = s.device.type == "cuda"
    index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]) if cuda else 0
    tmp = args.records or Path(tempfile.mkdtemp(prefix="start-aftereffect-"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", str(tmp))
    s.user_run = None
    if args.user_wandb:
        import paths

        s.user_run = paths.open_wandb_run(tmp, "start-aftereffect", args.quick)
    block = Block(s, args, tmp, index, simulated=not cuda)
    rounds = lr.Rounds(tuple(arms))
    def extra() -> dict[str, Any]:
        return {"since_start_s": block.since_start, "start_s": block.start_s,
                "reads": block.reads, "probes": block.probes,
                "reader_errors": s.reader_errors, "skipped": skipped,
                "user_wandb": args.user_wandb}

    rounds.run(args, block, extra)
    hw = og.hardware(s)
    lines = [f"## Steps around a monitor's start, on a plain loop that syncs every step "
             f"({hw.get('gpu', hw['device'])})",
             f"model {s.n_params / 1e6:.1f}M params, batch {s.batch_size} x {s.seq_len}; "
             f"{rounds.rounds} rounds of {args.burn} steps, the arm's start, {args.steps} "
             f"counted steps; interval {args.interval:g} s"
             + ("; the loop logs to a W&B run of its own every step" if args.user_wandb
                else "")
             + (f"; skipped: {', '.join(skipped)}" if skipped else ""), "",
             paired.table(rounds.comparisons("off", args.seed), 0.3), "",
             *rounds.profile_table("off", args.burn), "", *block.since_table(), "",
             *block.probe_lines(), "", *block.reads_lines(),
             *(f"a reader's last error line: {e}" for e in sorted(set(s.reader_errors)))]
    lr.write(args, lines, rounds, "off", extra(), s)
    if s.user_run is not None:
        og.wandb_finish(s.user_run)


if __name__ == "__main__":
    main()
