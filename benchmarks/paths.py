"""The user paths the overhead benchmarks time, one *block* at a time (issue 18).

A block is one short run of one arm: a Hugging Face ``Trainer.train()``, a Lightning
``Trainer.fit()`` or a plain loop with a W&B run, of ``warmup + steps`` optimizer steps, with
gpulens (arm ``gpulens``) or without (``base``; the A/A arm runs the same code), over a fresh
copy of one warmed model (the process has chosen its kernels and grown its allocator before the
first block; a copy keeps no hook of an earlier block, DDP's included). gpulens's monitor starts
and stops with its block, outside the timed steps: start and stop are not what is measured.

A stamp at the end of every optimizer step (HF's ``on_step_end``, Lightning's
``on_train_batch_end``, the loop's own) reads three clocks:

* on a GPU, the GPU's timeline: a CUDA event recorded on the current stream, so a step's time
  is the time between two such events as the GPU ran them, with no device sync added: host
  work that the GPU's queue hides costs nothing there, host work that starves the GPU shows;
* the host's wall clock (``perf_counter``): the step time on a CPU;
* the training thread's CPU time (``time.thread_time``);
* the process's CPU time (``CLOCK_PROCESS_CPUTIME_ID``, one system call): less the training
  thread's, what every *other* thread of the training process spent in the step (gpulens's
  threads, a tracker's, torch's and NCCL's). In a loop whose training thread is busy on the CPU,
  a background thread's Python takes the GIL from it, so this is where a cost that the training
  thread's own CPU does not show appears.

A block's value is the median of its timed steps (the steps after the warm-up). Besides such
blocks (one training run per arm), each path runs a :class:`Schedule`: one training run through
short blocks of every arm in turn, gpulens's hooks gated to its own blocks (:func:`gated`).
Both ``callback_cost.py`` (the training thread's CPU, on a CPU) and ``paths_aa.py`` (step time
against an A/A arm, on a GPU) run from here; ``overhead_gpu.py`` builds the model.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead_gpu as og  # benchmarks/overhead_gpu.py: the model, its warm-up, W&B helpers
import paired  # the seeded order of the arms

Instrument = Callable[[Any, "Clock"], None]
"""Called with gpulens's callback (or monitor) of a ``gpulens`` block and the block's clock
before it trains."""


class Clock:
    """Stamps at the end of each step; the steps' times read back after the block."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.proc: list[float] = []
        self.events: list[Any] = []
        self.listeners: list[Callable[[int], None]] = []
        """Called with the stamp's index after each stamp: their work falls into the next
        step."""
        self.before: list[Callable[[int], None]] = []
        """Called with the index the stamp will have, before it: their work falls into the step
        the stamp ends."""
        self.epoch = time.time() - time.perf_counter()
        """Add to a ``wall`` stamp for Unix seconds (to line blocks up with a GPU log)."""
        self.gc: list[tuple[float, int]] = []
        """At each stamp: (seconds the garbage collector has run, its full collections) since
        :meth:`watch_gc`, in any thread (the collector holds the GIL: training waits)."""
        self._gc_s = 0.0
        self._gc_full = 0
        self._gc_t0 = 0.0

        self.forwards: dict[int, Any] = {}
        """Stamp count -> the event (or host time) of the first forward that began after that
        many stamps (:meth:`forward_begins`): splits a step into its gap and its busy part."""

    def forward_begins(self) -> None:
        """At a step's first forward (a pre-hook of the benchmark's, in every arm, before
        gpulens's): an event on the GPU's timeline (no sync), so each step splits into the
        *gap* (the previous step's end to this forward: what the host did between, HF's log
        and sync included, with the GPU idle once its queue ran dry) and the *busy* part (this
        forward to the step's end)."""
        k = len(self.cpu)
        if k in self.forwards:
            return  # a later forward of the same step (gradient accumulation)
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.forwards[k] = event
        else:
            self.forwards[k] = time.perf_counter()

    def split(self, index: int) -> tuple[float, float] | None:
        """(gap, busy) seconds of the step that stamp ``index + 1`` ended, once every stamp
        has run (after :meth:`steps`); ``None`` without a forward mark in it."""
        fwd = self.forwards.get(index + 1)
        if fwd is None or index + 1 >= len(self.wall):
            return None
        if self.cuda:
            a, b = self.events[index], self.events[index + 1]
            return a.elapsed_time(fwd) / 1e3, fwd.elapsed_time(b) / 1e3
        return fwd - self.wall[index], self.wall[index + 1] - fwd

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        self._gc_s += time.perf_counter() - self._gc_t0
        self._gc_full += info.get("generation") == 2

    def watch_gc(self) -> None:
        """Time every garbage collection until :meth:`unwatch_gc` (``gc.callbacks``)."""
        gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def stamp(self) -> None:
        """End a step: :attr:`before` (their work is the ending step's), its stamps, then
        :attr:`listeners` (their work is the next step's)."""
        for hook in self.before:
            hook(len(self.cpu))
        self.gc.append((self._gc_s, self._gc_full))
        self.cpu.append(time.thread_time())
        self.proc.append(time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID))
        self.wall.append(time.perf_counter())
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        for listener in self.listeners:
            listener(len(self.cpu) - 1)

    def steps(self, warmup: int) -> tuple[list[float], list[float]]:
        """(seconds, training-thread CPU seconds) of each step after the first ``warmup``:
        stamp ``k`` ends step ``k + 1``, so step ``k + 1``'s time is stamp ``k`` - stamp
        ``k - 1``."""
        first = max(1, warmup)
        cpu = [b - a for a, b in zip(self.cpu[first - 1:], self.cpu[first:], strict=False)]
        if self.cuda and self.events:
            self.events[-1].synchronize()  # after the block: every stamp has run
            pairs = zip(self.events[first - 1:], self.events[first:], strict=False)
            wall = [a.elapsed_time(b) / 1e3 for a, b in pairs]
        else:
            wall = [b - a for a, b in zip(self.wall[first - 1:], self.wall[first:], strict=False)]
        return wall, cpu

    def others(self, warmup: int) -> list[float]:
        """CPU seconds of the process's other threads in each step after the first
        ``warmup`` (the process's CPU less the training thread's; see the module doc)."""
        first = max(1, warmup)
        return [max(0.0, (p1 - p0) - (c1 - c0)) for p0, p1, c0, c1 in zip(
            self.proc[first - 1:], self.proc[first:], self.cpu[first - 1:], self.cpu[first:],
            strict=False)]


def threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads but the calling one, summed by name: a Python
    thread's name with its digits dropped (a pool's workers add up), else ``(native)``.  Read
    from ``/proc/self/task/*/schedstat`` (nanoseconds), or ``stat`` (clock ticks)."""
    names = {t.native_id: re.sub(r"\d+", "N", t.name) for t in threading.enumerate()}
    me = threading.get_native_id()
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        if tid == me:
            continue
        try:
            spent = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                spent = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, ValueError, IndexError):
                continue  # the thread ended
        name = names.get(tid, "(native)")
        out[name] = out.get(name, 0.0) + spent
    return out


@dataclass
class Block:
    """One arm's run in one round."""

    arm: str
    round: int
    step_s: list[float]
    cpu_s: list[float]
    note: str = ""
    rank_values_s: list[float] = field(default_factory=list)
    """In a distributed run: every rank's block value (``value_s`` is the slowest's)."""
    others_s: list[float] = field(default_factory=list)
    """CPU seconds of the training process's other threads in each timed step."""

    @property
    def value_s(self) -> float:
        """The median step (seconds)."""
        return statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def cpu_per_step_s(self) -> float:
        """The median training-thread CPU seconds of a step."""
        return statistics.median(self.cpu_s) if self.cpu_s else float("nan")

    @property
    def others_per_step_s(self) -> float:
        """The mean CPU seconds of the process's other threads per step (a mean: their work
        comes in bursts, a row's every few steps)."""
        return statistics.fmean(self.others_s) if self.others_s else float("nan")


def kind_of(arm: str) -> str:
    """``"gpulens"`` for an arm that runs gpulens, ``"dsm"`` for Lightning's
    ``DeviceStatsMonitor``, else ``"base"`` (the baseline and its A/A arm run the same code)."""
    if arm.endswith("gpulens"):
        return "gpulens"
    return "dsm" if arm.endswith("_dsm") else "base"


@dataclass
class Schedule:
    """Short blocks of every arm, one after another in ONE training run (``--mode
    interleaved`` of ``paths_aa.py``).

    Steps ``1..warmup`` belong to no arm; then round after round, each runs every arm once as
    a block of ``burn + measured`` steps, in the order ``paired.round_order`` gives (seeded).
    Only the last ``measured`` steps of a block count: the first ``burn`` take what the
    previous block left behind (its last log's hook runs after its last step's stamp, its
    rows reach W&B a quarter of a second later). ``measured`` is a multiple of the logging
    interval, so each block's counted steps hold the same number of logs. gpulens runs only in
    the gpulens arm's blocks, as if each were a training run of its own: its monitor starts at
    a block's first step and stops at the next block's first (both in burn-in steps), so its
    engine process and its hooks are there in its blocks and nowhere else (:func:`gated`).
    """

    arms: list[str]
    rounds: int
    first_round: int
    seed: int
    measured: int
    burn: int
    warmup: int
    orders: list[list[str]] = field(init=False)
    threads_s: dict[str, dict[str, float]] = field(init=False, default_factory=dict)
    """Per arm, the CPU seconds of this process's other threads by name (:func:`threads_cpu`)
    over its counted steps, once :meth:`watch_threads` has watched a run."""
    thread_steps: dict[str, int] = field(init=False, default_factory=dict)
    """Per arm, the counted steps ``threads_s`` covers."""
    round_wall_s: float = field(init=False, default=float("nan"))
    """Host wall-clock seconds a round took (starts and stops included), once :meth:`values`
    has read the run's clock."""
    steps: dict[tuple[int, str], dict[str, list[float]]] = field(init=False,
                                                                 default_factory=dict)
    """(round, arm) -> its counted steps, once :meth:`values` has read the run's clock: ``ms``
    (each step), ``cpu_ms`` (the training thread's CPU), ``gc_ms`` (the collector's time),
    ``full_gc`` (full collections), ``span`` (Unix seconds at the block's first counted
    step's start and its last step's end, host clock), and where the path marks its forwards
    (``Clock.forward_begins``) ``gap_ms`` and ``busy_ms`` (:meth:`Clock.split`)."""
    profile_s: dict[str, list[float]] = field(init=False, default_factory=dict)
    """Per arm, the mean seconds of the step at each position of its blocks (burn-in steps
    included), over the rounds, once :meth:`values` has read the run's clock: whether a cost
    sits in the first steps after a start (a transient) or in every step (the steady state)."""

    def __post_init__(self) -> None:
        self.orders = [paired.round_order(self.arms, self.seed, self.first_round + r)
                       for r in range(self.rounds)]

    @property
    def block(self) -> int:
        return self.burn + self.measured

    @property
    def total_steps(self) -> int:
        """Warm-up, the blocks, and a tail of ``burn`` steps for the last block's rows."""
        return self.warmup + self.rounds * len(self.arms) * self.block + self.burn

    def place(self, step: int) -> tuple[int, str, bool] | None:
        """(round, arm, counted) of optimizer step ``step`` (from 1); ``None`` outside the
        blocks."""
        i = step - self.warmup - 1
        if i < 0:
            return None
        block, pos = divmod(i, self.block)
        rnd, k = divmod(block, len(self.arms))
        if rnd >= self.rounds:
            return None
        return self.first_round + rnd, self.orders[rnd][k], pos >= self.burn

    def runs(self, kind: str) -> Callable[[int], bool]:
        """Whether step ``step`` is in a block of an arm of ``kind`` (``kind_of``)."""
        def on(step: int) -> bool:
            where = self.place(step)
            return where is not None and kind_of(where[1]) == kind
        return on

    def runs_arm(self, arm: str) -> Callable[[int], bool]:
        """Whether step ``step`` is in a block of ``arm``."""
        def on(step: int) -> bool:
            where = self.place(step)
            return where is not None and where[1] == arm
        return on

    def watch_threads(self, clock: Clock) -> None:
        """Read :func:`threads_cpu` before each block's first counted step and after its last
        (two reads a block, in the stamps between steps) into :attr:`threads_s`.  Each read
        falls into a burn-in step: the first before the stamp that ends the block's last
        burn-in step, the other after the stamp that ends its last counted step (with no
        burn-in, both after: the first then falls into a counted step)."""
        at: dict[str, float] = {}

        def blocks_at(index: int) -> tuple[Any, Any]:
            step = index + 1  # stamp k ends step k + 1
            this, following = self.place(step), self.place(step + 1)
            this_block = this[:2] if this is not None and this[2] else None
            next_block = following[:2] if following is not None and following[2] else None
            return this_block, next_block

        def start(index: int) -> None:
            at.clear()
            at.update(threads_cpu())

        def before(index: int) -> None:
            this_block, next_block = blocks_at(index)
            if next_block is not None and this_block is None:
                start(index)

        def after(index: int) -> None:
            this_block, next_block = blocks_at(index)
            if this_block is not None and this_block != next_block:
                arm = this_block[1]
                totals = self.threads_s.setdefault(arm, {})
                for name, spent in threads_cpu().items():
                    totals[name] = totals.get(name, 0.0) + spent - at.get(name, 0.0)
                self.thread_steps[arm] = self.thread_steps.get(arm, 0) + self.measured
                if next_block is not None:  # no burn-in between the blocks
                    start(index)

        clock.before.append(before)
        clock.listeners.append(after)

    def values(self, clock: Clock) -> dict[tuple[int, str], tuple[float, float, float]]:
        """(round, arm) -> (mean step seconds, mean training-thread CPU seconds, mean CPU
        seconds of the process's other threads) of the counted steps."""
        wall, cpu = clock.steps(1)  # step s (from 2) is index s - 2
        others = clock.others(1)
        first, last = self.warmup, self.warmup + self.rounds * len(self.arms) * self.block
        if len(clock.wall) >= last:  # stamp k ends step k + 1
            self.round_wall_s = (clock.wall[last - 1] - clock.wall[first - 1]) / self.rounds
        sums: dict[tuple[int, str], list[float]] = {}
        by_pos: dict[str, list[list[float]]] = {}
        for index, (w, c, o) in enumerate(zip(wall, cpu, others, strict=True)):
            where = self.place(index + 2)
            if where is not None:
                pos = (index + 2 - self.warmup - 1) % self.block
                slots = by_pos.setdefault(where[1], [[0.0, 0] for _ in range(self.block)])
                slots[pos][0] += w
                slots[pos][1] += 1
            if where is not None and where[2] and index + 1 < len(clock.gc):
                rec = self.steps.setdefault(where[:2], {"ms": [], "cpu_ms": [], "gc_ms": [],
                                                        "full_gc": [], "span": []})
                parts = clock.split(index)
                if parts is not None:
                    rec.setdefault("gap_ms", []).append(round(parts[0] * 1e3, 4))
                    rec.setdefault("busy_ms", []).append(round(parts[1] * 1e3, 4))
                (g0, f0), (g1, f1) = clock.gc[index], clock.gc[index + 1]
                rec["ms"].append(round(w * 1e3, 4))
                rec["cpu_ms"].append(round(c * 1e3, 4))
                rec["gc_ms"].append(round((g1 - g0) * 1e3, 4))
                rec["full_gc"].append(f1 - f0)
                if not rec["span"]:
                    rec["span"] = [clock.epoch + clock.wall[index], 0.0]
                rec["span"][1] = clock.epoch + clock.wall[index + 1]
            if where is not None and where[2]:
                acc = sums.setdefault(where[:2], [0.0, 0.0, 0.0, 0.0])
                acc[0] += w
                acc[1] += c
                acc[2] += o
                acc[3] += 1
        self.profile_s = {arm: [t / n if n else math.nan for t, n in slots]
                          for arm, slots in by_pos.items()}
        return {k: (v[0] / v[3], v[1] / v[3], v[2] / v[3]) for k, v in sums.items()}


def gpulens_callbacks(arm: str, module: str, interval: float, clock: Clock,
                      instrument: Instrument | None,
                      variant: dict[str, Any] | None = None) -> list[Any]:
    """``[GPUMonitorCallback(interval)]`` of ``module`` for a gpulens arm, else ``[]``;
    ``GPULENS_PATHS_MONITOR_KW`` (JSON) replaces fields of its settings, and
    ``GPULENS_PATHS_CALLBACK_KW`` (JSON) attributes of the callback, e.g.
    ``{"follow_report_to": false}``: rows to a JSONL file instead of the framework's W&B run.
    ``variant``: the same for one arm (``paths_aa.py --variants``): callback attributes, and
    settings fields under ``"monitor"``."""
    if kind_of(arm) != "gpulens":
        return []
    import importlib

    callback = importlib.import_module(module).GPUMonitorCallback(interval=interval)
    variant = dict(variant or {})
    extra = {**json.loads(os.environ.get("GPULENS_PATHS_MONITOR_KW") or "{}"),
             **variant.pop("monitor", {})}
    if extra:  # which reads cost, e.g. {"gpm": false, "energy": false, "driver_samples": false}
        import dataclasses

        callback.settings = dataclasses.replace(callback.settings, **extra)
    attrs = {**json.loads(os.environ.get("GPULENS_PATHS_CALLBACK_KW") or "{}"), **variant}
    for name, value in attrs.items():
        if not hasattr(callback, name):
            raise SystemExit(f"GPULENS_PATHS_CALLBACK_KW or --variants: the callback has no "
                             f"attribute {name!r}")
        setattr(callback, name, value)
    if instrument is not None:
        instrument(callback, clock)
    return [callback]


HF_GATED = ("on_pre_optimizer_step", "on_substep_end", "on_step_end", "on_log", "on_epoch_begin",
            "on_prediction_step", "on_evaluate", "on_save")
PL_GATED = ("on_before_optimizer_step", "on_train_batch_end", "on_train_epoch_start",
            "on_validation_end")
PL_ALWAYS = ("setup", "teardown", "on_exception")


def gated(inner: Any, on: Callable[[int], bool], framework: str) -> Any:
    """A callback that runs ``inner`` as if each stretch of steps ``on`` names were a training
    run of its own: at the first step of a stretch it gets its start hook (HF
    ``on_train_begin``, Lightning ``on_train_start``: gpulens starts its monitor there, at that
    step, and attaches its token counter), then every per-step hook, and at the first step
    after the stretch its end hook (a last row, the monitor stopped). Between stretches it gets
    nothing: no hook, no monitor, no engine process."""
    if framework == "hf":
        from transformers import TrainerCallback as Base
    else:
        from lightning.pytorch import Callback as Base

    class Gate(Base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.active = False
            self.batches = 0

        @property
        def state_key(self) -> str:
            return f"Gate[{type(inner).__name__}]"

        def switch(self, active: bool, start: str, end: str, *args: Any, **kw: Any) -> None:
            if active and not self.active:
                getattr(inner, start)(*args, **kw)
            elif self.active and not active:
                getattr(inner, end)(*args, **kw)
            self.active = active

        # Hugging Face (its own train begin starts nothing: the warm-up is off)
        def on_train_begin(self, *args: Any, **kw: Any) -> None:
            return None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.switch(on(int(state.global_step) + 1), "on_train_begin", "on_train_end",
                        args, state, control, **kw)
            if self.active:
                inner.on_step_begin(args, state, control, **kw)

        def on_train_end(self, *args: Any, **kw: Any) -> None:
            if self.active:  # HF and Lightning alike
                inner.on_train_end(*args, **kw)
            self.active = False

        # Lightning
        def on_train_start(self, *args: Any) -> None:
            return None

        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            self.batches += 1
            self.switch(on(self.batches), "on_train_start", "on_train_end", trainer, module)
            if self.active:
                inner.on_train_batch_start(trainer, module, *args)

    def forward(name: str, always: bool) -> Callable[..., Any]:
        def hook(self: Any, *args: Any, **kw: Any) -> Any:
            if always or self.active:
                return getattr(inner, name)(*args, **kw)
            return None
        return hook

    for name in HF_GATED if framework == "hf" else PL_GATED:
        setattr(Gate, name, forward(name, False))
    if framework != "hf":
        for name in PL_ALWAYS:
            setattr(Gate, name, forward(name, True))
    return Gate()


class HfPath:
    """Hugging Face ``Trainer`` on the warmed model, ``logging_steps=log_every``, with the
    trackers of ``report_to`` (W&B: the run the caller opened, which HF's ``WandbCallback``
    uses), a dataset of token rows with an attention mask (a quarter of each row padded in
    every other row), collated and moved to the device by the Trainer as a user's data is;
    ``gpulens``: plus ``GPUMonitorCallback(interval)``."""

    def __init__(self, s: og.Setup, tmp: Path, log_every: int, report_to: list[str],
                 interval: float, variants: dict[str, dict[str, Any]] | None = None) -> None:
        import torch

        self.variants = variants or {}
        """Arm -> its gpulens callback's attributes (``gpulens_callbacks``' ``variant``)."""
        self.s, self.tmp, self.log_every = s, tmp, log_every
        self.report_to, self.interval = report_to, interval
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        g = torch.Generator().manual_seed(2)
        n = max(64, 4 * s.batch_size)
        self.ids = torch.randint(0, s.config.vocab_size, (n, s.seq_len), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[::2, -(s.seq_len // 4):] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self.name = f"hf_ls{log_every}"

    def dataset(self, steps: int) -> Any:
        import torch

        ids, mask, labels = self.ids, self.mask, self.labels
        length = (steps + 1) * self.s.batch_size * self.world

        class Rows(torch.utils.data.Dataset):  # type: ignore[misc]
            def __len__(self) -> int:
                return length

            def __getitem__(self, i: int) -> dict[str, Any]:
                j = i % len(ids)
                return {"input_ids": ids[j], "attention_mask": mask[j], "labels": labels[j]}

        return Rows()

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        """One ``train()`` of ``warmup + steps`` steps for ``arm`` alone."""
        clock = Clock(self.s.device.type == "cuda")
        extra = gpulens_callbacks(arm, "gpulens.integrations.transformers", self.interval,
                                  clock, instrument)
        self._train(f"{arm}-{rnd}", warmup + steps, extra, clock)
        return Block(arm, rnd, *clock.steps(warmup), others_s=clock.others(warmup))

    def interleaved(self, schedule: Schedule) -> dict[tuple[int, str], tuple[float, float, float]]:
        """One ``train()`` through every block of ``schedule``."""
        clock = Clock(self.s.device.type == "cuda")
        extra = [gated(cb, schedule.runs_arm(arm), "hf")
                 for arm in schedule.arms if kind_of(arm) == "gpulens"
                 for cb in gpulens_callbacks(arm, "gpulens.integrations.transformers",
                                             self.interval, clock, None,
                                             self.variants.get(arm))]
        schedule.watch_threads(clock)
        clock.watch_gc()
        try:
            self._train(f"interleaved-{schedule.first_round}", schedule.total_steps, extra, clock)
        finally:
            clock.unwatch_gc()
        return schedule.values(clock)

    def _train(self, name: str, steps: int, extra: list[Any], clock: Clock) -> None:
        from transformers import Trainer, TrainerCallback, TrainingArguments

        s = self.s

        class Stamp(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.stamp()

        cuda = s.device.type == "cuda"
        targs = TrainingArguments(
            output_dir=str(self.tmp / "hf" / name), max_steps=steps,
            per_device_train_batch_size=s.batch_size, logging_steps=self.log_every,
            report_to=self.report_to, save_strategy="no", eval_strategy="no",
            optim="adamw_torch_fused" if cuda else "adamw_torch", learning_rate=1e-4,
            lr_scheduler_type="constant", warmup_steps=0, dataloader_num_workers=0,
            dataloader_pin_memory=cuda, disable_tqdm=True, use_cpu=not cuda, seed=0,
            bf16=False, ddp_find_unused_parameters=False,
        )
        model = copy.deepcopy(s.model)
        model.register_forward_pre_hook(lambda *_: clock.forward_begins())  # before gpulens's
        trainer = Trainer(model=model, args=targs, train_dataset=self.dataset(steps),
                          callbacks=[*extra, Stamp()])
        trainer.train()
        del trainer, model, extra
        gc.collect()


class LightningPath:
    """A ``lightning.pytorch.Trainer`` over a module wrapping a copy of the warmed model
    (``self.model``: its Hugging Face config gives gpulens the FLOPs), fed the setup's batches
    as dicts with an attention mask (no data loading), a CSV logger, ``log_every_n_steps``;
    ``gpulens``: plus ``GPUMonitorCallback(interval)`` (rows to the CSV logger); ``*_dsm``:
    plus Lightning's ``DeviceStatsMonitor``."""

    def __init__(self, s: og.Setup, tmp: Path, log_every: int, interval: float) -> None:
        import torch

        self.s, self.tmp, self.log_every, self.interval = s, tmp, log_every, interval
        self.name = f"lightning_ls{log_every}"
        self.batches = []
        for ids in s.batches:
            mask = torch.ones_like(ids)
            mask[::2, -(s.seq_len // 4):] = 0
            self.batches.append({"input_ids": ids, "attention_mask": mask,
                                 "labels": ids.masked_fill(mask == 0, -100)})

    def _dsm(self) -> Any:
        """Lightning's own peer; on a CPU it has only CPU figures."""
        from lightning.pytorch.callbacks import DeviceStatsMonitor

        return DeviceStatsMonitor(cpu_stats=True if self.s.device.type == "cpu" else None)

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        """One ``fit()`` of ``warmup + steps`` steps for ``arm`` alone."""
        clock = Clock(self.s.device.type == "cuda")
        extra = gpulens_callbacks(arm, "gpulens.integrations.lightning", self.interval, clock,
                                  instrument)
        if kind_of(arm) == "dsm":
            extra.append(self._dsm())
        self._fit(f"{arm}-{rnd}", warmup + steps, extra, clock)
        return Block(arm, rnd, *clock.steps(warmup), others_s=clock.others(warmup))

    def interleaved(self, schedule: Schedule) -> dict[tuple[int, str], tuple[float, float, float]]:
        """One ``fit()`` through every block of ``schedule``."""
        clock = Clock(self.s.device.type == "cuda")
        extra = [gated(cb, schedule.runs("gpulens"), "pl") for cb in gpulens_callbacks(
            "gpulens", "gpulens.integrations.lightning", self.interval, clock, None)]
        if any(kind_of(a) == "dsm" for a in schedule.arms):
            extra.append(gated(self._dsm(), schedule.runs("dsm"), "pl"))
        schedule.watch_threads(clock)
        clock.watch_gc()
        try:
            self._fit(f"interleaved-{schedule.first_round}", schedule.total_steps, extra, clock)
        finally:
            clock.unwatch_gc()
        return schedule.values(clock)

    def _fit(self, name: str, steps: int, extra: list[Any], clock: Clock) -> None:
        import lightning.pytorch as pl
        import torch
        from lightning.pytorch.loggers import CSVLogger

        s = self.s
        batches = self.batches
        device = s.device

        class Module(pl.LightningModule):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.model = copy.deepcopy(s.model)
                self.model.register_forward_pre_hook(lambda *_: clock.forward_begins())

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                loss = self.model(**batch).loss
                self.log("loss", loss, on_step=True, on_epoch=False)
                return loss

            def configure_optimizers(self) -> Any:
                return og.make_optimizer(torch, self.model, device)

            def train_dataloader(self) -> Any:
                return torch.utils.data.DataLoader(Cycle(), batch_size=None)

        class Cycle(torch.utils.data.IterableDataset):  # type: ignore[misc]
            def __iter__(self) -> Any:
                i = 0
                while True:
                    yield batches[i % len(batches)]
                    i += 1

        class Stamp(pl.Callback):  # type: ignore[misc]
            def on_train_batch_end(self, *args: Any) -> None:
                clock.stamp()

        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
            max_steps=steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
            logger=CSVLogger(str(self.tmp / "lightning"), name=name),
            log_every_n_steps=self.log_every, callbacks=[*extra, Stamp()],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Module())
        del trainer, extra
        gc.collect()


class WandbLoopPath:
    """A W&B user's plain loop on the warmed model: ``run.log({"train/loss": loss})`` every
    step (the loss read with ``.item()``) into the run the caller opened; ``gpulens``: plus
    ``Monitor(interval, sinks=["wandb"])`` and ``mon.log(step)`` after each step (rows into
    the same run, written from the W&B sink's own thread)."""

    name = "wandb_loop"

    def __init__(self, s: og.Setup, interval: float) -> None:
        self.s, self.interval = s, interval

    def block(self, arm: str, rnd: int, warmup: int, steps: int,
              instrument: Instrument | None = None) -> Block:
        """One loop of ``warmup + steps`` steps for ``arm`` alone (its monitor started for
        it)."""
        clock = Clock(self.s.device.type == "cuda")
        gpulens = kind_of(arm) == "gpulens"
        self._loop(warmup + steps, (lambda step: True) if gpulens else None, clock, instrument)
        return Block(arm, rnd, *clock.steps(warmup), others_s=clock.others(warmup))

    def interleaved(self, schedule: Schedule) -> dict[tuple[int, str], tuple[float, float, float]]:
        """One loop through every block of ``schedule``; a monitor is started at the first
        step of each gpulens block and stopped at the first step after it."""
        clock = Clock(self.s.device.type == "cuda")
        schedule.watch_threads(clock)
        clock.watch_gc()
        try:
            self._loop(schedule.total_steps, schedule.runs("gpulens"), clock, None)
        finally:
            clock.unwatch_gc()
        return schedule.values(clock)

    def _loop(self, steps: int, on: Callable[[int], bool] | None, clock: Clock,
              instrument: Instrument | None) -> None:
        import torch
        import wandb

        import gpulens

        s = self.s
        model = copy.deepcopy(s.model)
        work = og.Setup(torch, s.device, model, og.make_optimizer(torch, model, s.device),
                        s.batches, s.batch_size, s.seq_len, s.n_params, s.config, s.quick)
        mon: Any = None
        run = wandb.run
        try:
            for step in range(1, steps + 1):
                active = on is not None and on(step)
                if active and mon is None:
                    mon = gpulens.Monitor(interval=self.interval, sinks=["wandb"])
                    if instrument is not None:
                        instrument(mon, clock)
                    mon.start(step=step - 1)
                elif not active and mon is not None:
                    mon.stop()
                    mon = None
                loss = og.train_step(work, step)
                run.log({"train/loss": loss})
                if mon is not None:
                    mon.log(step)
                clock.stamp()
        finally:
            if mon is not None:
                mon.stop()
        del work, model
        gc.collect()


def open_wandb_run(tmp: Path, name: str, quick: bool = False) -> Any:
    """One offline W&B run for every block of the benchmark (W&B's system metrics every
    15 s, its default, as a user's run has them); ``quick``: see ``og.wandb_init``."""
    return og.wandb_init(tmp, name, stats_interval=15.0, quick=quick)


__all__ = ["Block", "Clock", "HfPath", "LightningPath", "Schedule", "WandbLoopPath", "gated",
           "kind_of", "open_wandb_run"]


def bench_options_from_env() -> None:
    """``GPULENS_BENCH_SAMPLE_THREADS=DIR``: sample gpulens's threads (:class:`ThreadSampler`)
    and write their stacks to ``DIR`` at exit.  ``GPULENS_BENCH_RELAY_POLL=FIRST,MAX``
    (seconds) sets the relay's poll intervals."""
    poll = os.environ.get("GPULENS_BENCH_RELAY_POLL")
    if poll:
        from gpulens.transport import relay

        first, most = (float(x) for x in poll.split(","))
        relay.POLL_FIRST_S, relay.POLL_MAX_S = first, most
    sampled = os.environ.get("GPULENS_BENCH_SAMPLE_THREADS")
    if sampled:
        ThreadSampler(Path(sampled)).start()


class ThreadSampler:
    """A sampling profiler of gpulens's threads (``cProfile`` cannot profile one thread of
    many on Python 3.12, where it is one profiler a process): every ``period`` seconds a
    daemon thread reads ``sys._current_frames()`` and counts, per gpulens thread name, the
    innermost ``depth`` frames of its stack (``file:function``, innermost first).  At exit it
    writes ``DIR/samples_rank{RANK}.txt``: per thread name, the stacks by count with their
    share.  A thread waiting (in a queue's ``get``, a sleep, a pipe read) is sampled too: read
    the stacks for where the time goes, the waits included.  The sampler takes the GIL once a
    period."""

    def __init__(self, out: Path, period: float = 0.005, depth: int = 8) -> None:
        self.out = out
        self.period = period
        self.depth = depth
        self.counts: dict[str, dict[tuple[str, ...], int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def start(self) -> None:
        import atexit

        self._thread.start()
        atexit.register(self.dump)

    def sample(self) -> None:
        """Count one sample of every gpulens thread's stack."""
        names = {t.ident: re.sub(r"\d+", "N", t.name) for t in threading.enumerate()
                 if t.name.startswith("gpulens")}
        for ident, frame in sys._current_frames().items():
            name = names.get(ident)
            if name is None:
                continue
            stack: list[str] = []
            f: Any = frame
            while f is not None and len(stack) < self.depth:
                code = f.f_code
                stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                f = f.f_back
            by_stack = self.counts.setdefault(name, {})
            by_stack[tuple(stack)] = by_stack.get(tuple(stack), 0) + 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def report(self, top: int = 25) -> str:
        lines: list[str] = []
        for name, by_stack in sorted(self.counts.items()):
            total = sum(by_stack.values())
            lines.append(f"===== {name}: {total} samples, every {self.period * 1e3:g} ms")
            for stack, n in sorted(by_stack.items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"{n:7d} {100 * n / total:5.1f} %  " + " < ".join(stack))
        return "\n".join(lines) + "\n"

    def dump(self) -> None:
        self._stop.set()
        self.out.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        (self.out / f"samples_rank{rank}.txt").write_text(self.report())
