"""The values of a tuning run: a configuration, the settings, one trial's figures, the result.

Everything here is plain data (no torch, no framework), so the sweep logic, the report and the
tests use it without a device. Units are in the names: ``_s`` seconds, ``_gb`` GB of 10^9
bytes, ``_pct`` percent, ``_per_s`` per second. A figure that was not measured is ``None``,
never 0 (an MFU without a known peak, GPU memory on a CPU run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "oom", "failed"]
"""``ok``: timed steps ran; ``oom``: the trial ran out of memory (recorded, survived);
``failed``: the trial could not be timed (the loader gave no batch, too few steps)."""


@dataclass(frozen=True, order=True)
class Config:
    """One point of the sweep: what a trial runs with.

    ``accumulation`` is the gradient-accumulation steps per optimizer step (1 unless a fixed
    global batch is kept). ``pin_memory`` and ``prefetch_factor`` ``None`` mean "the loader's
    own setting, untouched".
    """

    batch_size: int
    num_workers: int = 0
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    accumulation: int = 1

    def label(self) -> str:
        """``batch 32, 4 workers`` (+ pinned / prefetch / accumulation when set)."""
        parts = [f"batch {self.batch_size}",
                 f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"]
        if self.accumulation > 1:
            parts.append(f"accumulation {self.accumulation}")
        if self.pin_memory is not None:
            parts.append("pinned memory" if self.pin_memory else "no pinned memory")
        if self.prefetch_factor is not None:
            parts.append(f"prefetch {self.prefetch_factor}")
        return ", ".join(parts)


@dataclass(frozen=True)
class TuneSettings:
    """How a sweep runs. One frozen value, checked once (:meth:`check`).

    Trials:
        warmup_steps: optimizer steps run before the timed window (loader workers start,
            kernels are chosen, the allocator fills); not timed.
        steps: optimizer steps in the timed window.
        max_trial_s: a trial's timed window ends after this many seconds even if fewer than
            ``steps`` ran (at least one step; single process only: under DDP every rank runs
            exactly ``steps`` steps, so no rank runs a step the others do not).
        budget_s: the whole sweep's time; no trial starts that would not finish within it (by
            the mean trial time so far). ``None``: no limit.
    Batch sizes:
        batch_sizes: the batch sizes allowed (per device); ``None``: powers of two and
            multiples of ``batch_multiple`` from ``min_batch`` to ``max_batch``.
        global_batch: keep ``batch x accumulation x world size`` equal to this; the sweep
            then varies how it splits (only batch sizes that divide it).
    Loader:
        workers: the ``num_workers`` values tried, ascending; a trial whose data wait is at or
            above ``data_wait_pct`` is repeated with the next count, and the worker sweep stops
            at the first count below it (or when more workers stopped helping).
        workers_per_cpu: leave out worker counts above the CPUs each rank may use (the CPUs
            of the process / ``LOCAL_WORLD_SIZE``); ``False`` tries them all.
        loader_options: also try ``pin_memory`` (CUDA only) and ``prefetch_factor`` 4 (when
            the data wait is still high) at the chosen batch size.
    Choice:
        tie_pct: throughputs within this many percent count as equal; the smaller batch (then
            fewer workers) wins a tie: more memory headroom, same speed.
        patience: the coarse pass stops after this many batch sizes in a row slower than the
            best (past the peak, not only at the out-of-memory edge).
        refine_trials: at most this many trials searching around the best batch size.
        confirm: measure the chosen configuration again at the end (after any out-of-memory
            trial), to show the figure holds.
    """

    warmup_steps: int = 3
    steps: int = 10
    max_trial_s: float | None = 30.0
    budget_s: float | None = None
    batch_sizes: tuple[int, ...] | None = None
    min_batch: int = 1
    max_batch: int = 65536
    batch_multiple: int = 8
    global_batch: int | None = None
    workers: tuple[int, ...] = (0, 1, 2, 4, 8)
    workers_per_cpu: bool = True
    data_wait_pct: float = 5.0
    loader_options: bool = True
    tie_pct: float = 1.0
    patience: int = 2
    refine_trials: int = 4
    confirm: bool = True

    def check(self) -> TuneSettings:
        """Raise ``ValueError`` (one line naming the setting) for a value that cannot work."""
        def positive(name: str, value: float | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if value is None or not value > 0 or (isinstance(value, float)
                                                  and math.isinf(value)):
                raise ValueError(f"gpulens tune: {name} must be a positive number, not "
                                 f"{value!r}")

        if self.warmup_steps < 0:
            raise ValueError(f"gpulens tune: warmup_steps must be >= 0, not {self.warmup_steps}")
        positive("steps", self.steps)
        positive("max_trial_s", self.max_trial_s, allow_none=True)
        positive("budget_s", self.budget_s, allow_none=True)
        positive("min_batch", self.min_batch)
        positive("batch_multiple", self.batch_multiple)
        positive("global_batch", self.global_batch, allow_none=True)
        if self.max_batch < self.min_batch:
            raise ValueError(f"gpulens tune: max_batch ({self.max_batch}) is below min_batch "
                             f"({self.min_batch})")
        if self.batch_sizes is not None and (
                not self.batch_sizes or any(b <= 0 for b in self.batch_sizes)):
            raise ValueError("gpulens tune: batch_sizes must be positive numbers, not "
                             f"{list(self.batch_sizes)!r}")
        if not self.workers or any(w < 0 for w in self.workers):
            raise ValueError(f"gpulens tune: workers must be counts >= 0, not "
                             f"{list(self.workers)!r}")
        if self.data_wait_pct < 0 or self.tie_pct < 0 or self.patience < 1 or \
                self.refine_trials < 0:
            raise ValueError("gpulens tune: data_wait_pct and tie_pct must be >= 0, patience "
                             ">= 1, refine_trials >= 0")
        return dataclasses.replace(self, workers=tuple(sorted(set(self.workers))),
                                   batch_sizes=None if self.batch_sizes is None
                                   else tuple(sorted(set(self.batch_sizes))))


@dataclass
class Trial:
    """What one trial measured (the figures of the slowest rank / fullest GPU under DDP).

    Rates are of the whole job (every rank together): under DDP each rank runs at the pace of
    the slowest, so the job's rate is ``world_size x`` the slowest rank's.
    """

    config: Config
    status: Status
    role: str = "sweep"
    """Why it ran: ``current`` (the user's setting), ``coarse``, ``workers``, ``refine``,
    ``loader``, ``confirm``."""
    steps: int = 0
    """Optimizer steps in the timed window."""
    seconds: float | None = None
    """Length of the timed window (s), device synchronised at both ends."""
    wall_s: float | None = None
    """The whole trial (s): loader start, warm-up, timed window, clean-up."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    """Seconds per optimizer step in the timed window."""
    data_wait_pct: float | None = None
    forward_backward_pct: float | None = None
    optimizer_pct: float | None = None
    data_wait_s: float | None = None
    """Seconds per optimizer step the training waited for its batches."""
    data_wait_by: str | None = None
    """Where the data wait comes from: ``window`` (timed in the window) or ``loader pace`` (the
    loader workers' own time per batch, larger: the window ran on batches queued before it;
    :mod:`gpulens.tune.pace`); ``None`` where no loader of the tuner's making was watched."""
    loader_batch_s: float | None = None
    """A loader worker's time per batch (s): the mean service time (a batch's finish less its
    start, in the worker) of the trial's batches begun before its window closed. Where no
    start was noted (a torch whose fetchers are not where :mod:`gpulens.tune.pace` looks),
    the lower quartile of the gaps between a worker's batches in the window, an upper bound
    where the loader keeps up. ``None`` without workers, with neither to read, or where the
    tuner did not build the loader."""
    forward_backward_s: float | None = None
    optimizer_s: float | None = None
    tflops: float | None = None
    """Achieved model TFLOP/s per GPU."""
    mfu_pct: float | None = None
    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    total_gb: float | None = None
    headroom_gb: float | None = None
    """``total_gb - peak_reserved_gb`` of the fullest GPU."""
    alloc_retries: int | None = None
    """The caching allocator's retries (``num_alloc_retries``) during the trial: it freed its
    cache and tried again; each is a device synchronisation and a sign of memory pressure."""
    world_size: int = 1
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.samples_per_s is not None

    @property
    def throughput(self) -> float:
        """The figure the sweep ranks by: samples/s (0.0 for a trial that did not run)."""
        return self.samples_per_s if self.ok and self.samples_per_s is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = dataclasses.asdict(self.config)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trial:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["config"] = Config(**data["config"])
        return cls(**values)


@dataclass
class TuneResult:
    """A finished sweep: every trial, the choice, the figures behind it.

    ``chosen`` is the trial whose configuration is recommended; ``current`` the measurement of
    the user's own setting (when it was given); ``oom_batch`` the smallest batch size that ran
    out of memory (``None``: none did; ``fits_batch`` is then the largest that ran).
    """

    trials: list[Trial]
    chosen: Trial | None
    current: Trial | None = None
    confirm: Trial | None = None
    oom_batch: int | None = None
    fits_batch: int | None = None
    stopped: str = "done"
    """``done``, or why the sweep ended early: ``budget`` (time), ``failed``, ``interrupted``
    (Ctrl-C: the trials that finished before it, a partial result)."""
    elapsed_s: float = 0.0
    settings: TuneSettings = field(default_factory=TuneSettings)
    device: str | None = None
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    """What the reader should know: options not swept and why, a limit reached."""

    @property
    def speedup_pct(self) -> float | None:
        """How much faster the chosen configuration is than the current one (%)."""
        if self.chosen is None or self.current is None or not self.current.ok:
            return None
        return 100.0 * (self.chosen.throughput / self.current.throughput - 1.0)

    @property
    def confirm_diff_pct(self) -> float | None:
        """The confirmation trial against the chosen trial's first measurement (%)."""
        if self.chosen is None or self.confirm is None or not self.confirm.ok:
            return None
        return 100.0 * (self.confirm.throughput / self.chosen.throughput - 1.0)

    def best_at(self, batch_size: int) -> Trial | None:
        ok = [t for t in self.trials if t.ok and t.config.batch_size == batch_size]
        return max(ok, key=lambda t: t.throughput, default=None)

    def to_dict(self) -> dict[str, Any]:
        index = {id(t): i for i, t in enumerate(self.trials)}

        def ref(t: Trial | None) -> int | None:
            return None if t is None else index.get(id(t))

        return {
            "trials": [t.to_dict() for t in self.trials],
            "chosen": ref(self.chosen), "current": ref(self.current),
            "confirm": ref(self.confirm), "oom_batch": self.oom_batch,
            "fits_batch": self.fits_batch, "stopped": self.stopped,
            "elapsed_s": self.elapsed_s, "settings": dataclasses.asdict(self.settings),
            "device": self.device, "world_size": self.world_size, "notes": list(self.notes),
            "speedup_pct": self.speedup_pct, "confirm_diff_pct": self.confirm_diff_pct,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneResult:
        trials = [Trial.from_dict(t) for t in data["trials"]]

        def at(i: int | None) -> Trial | None:
            return None if i is None else trials[i]

        settings = dict(data.get("settings") or {})
        for name in ("batch_sizes", "workers"):
            if settings.get(name) is not None:
                settings[name] = tuple(settings[name])
        return cls(trials=trials, chosen=at(data.get("chosen")), current=at(data.get("current")),
                   confirm=at(data.get("confirm")), oom_batch=data.get("oom_batch"),
                   fits_batch=data.get("fits_batch"), stopped=data.get("stopped", "done"),
                   elapsed_s=float(data.get("elapsed_s", 0.0)),
                   settings=TuneSettings(**settings), device=data.get("device"),
                   world_size=int(data.get("world_size", 1)), notes=list(data.get("notes", [])))


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep: a ``KeyboardInterrupt`` (it ends a program as one does) that
    carries the partial :class:`TuneResult` of the trials that finished, ``stopped`` set to
    ``interrupted``. The running trial was abandoned, and the model, optimizer and random
    generators were put back as after a whole sweep; the choice was not applied."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__(f"gpulens tune: interrupted after {len(result.trials)} trial(s)")
        self.result = result


def workers_grid(requested: Sequence[int], cpus: int | None) -> tuple[int, ...]:
    """The worker counts to try: ``requested`` without counts above the CPUs this process may
    use (one loader worker per CPU at most; the largest count at or below stays)."""
    grid = sorted(set(requested))
    if cpus is None or cpus < 1:
        return tuple(grid)
    kept = [w for w in grid if w <= cpus]
    return tuple(kept or grid[:1])
