"""The search: which configuration to measure next, and which one wins. Pure logic: it calls a
``measure(config, role) -> Trial`` function and never touches a device, so every path of it is
tested with a made-up measure function.

The order of trials:

1. **current**: the user's own setting, when known (the recommendation is stated against it).
2. **coarse**: the coarse batch sizes (:meth:`BatchSpace.coarse`, about doubling), ascending.
   At each size the loader workers start at the count the previous size needed and go up the
   ``workers`` grid while the data wait is at or above ``data_wait_pct`` (and more workers
   still help, by more than ``tie_pct``): the **worker sweep stops at the first count whose
   data wait is below the target**. The pass ends at the first size that runs out of memory
   (or cannot run), or after ``patience`` sizes in a row slower than the best: past the peak
   of throughput the sweep does not walk on to the memory edge.
3. **refine**: around the best size so far, the allowed size at the geometric middle of it and
   each measured neighbour (:meth:`BatchSpace.between`), repeated while there is one and
   ``refine_trials`` lasts. The search follows throughput, not the memory edge: it reaches
   toward an out-of-memory neighbour only when the best size is the largest that fitted.
4. **loader**: at the chosen batch size, ``pin_memory`` flipped (CUDA only) and
   ``prefetch_factor`` 4 (when the data wait stayed above the target with workers).
5. **confirm**: the chosen configuration once more, last (after any out-of-memory trial).

**The choice**: the highest throughput (samples/s); among trials within ``tie_pct`` of it, the
smallest batch size, then the fewest workers, then the loader's own options (same speed, more
memory headroom, less CPU, fewer changes). A trial during which the caching allocator had to
free its cache and retry (``alloc_retries`` > 0) ran at the memory edge and is chosen only when
no trial ran without: on an H200 the sweep's fastest batch (192 of GPT-2 small, 1 retry, 9 GB
headroom) ran out of memory twice when run again later in the same process
(``benchmarks/results/2026-11-27-h200x4-call2/tune``), where the next size down ran clean.

**Time**: before each trial the sweep checks that the mean trial time fits in what is left of
``budget_s``. The time counted is the sum of the trials' own ``wall_s`` (under DDP the agreed,
slowest rank's), so every rank makes the same decision.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from gpulens.tune.model import Config, Trial, TuneInterrupted, TuneResult, TuneSettings
from gpulens.tune.space import BatchSpace

Measure = Callable[[Config, str], Trial]
"""``measure(config, role)``: run one trial (or, under DDP, one trial on every rank and agree on
its figures) and return it; an out-of-memory trial comes back with ``status="oom"``."""


class Progress(Protocol):
    """What a progress display is told (:mod:`gpulens.tune.progress`)."""

    def update(self, trial: Trial, done: int, expected: int, spent_s: float,
               left_s: float | None) -> None:
        """A trial finished: ``done`` so far, about ``expected`` in all, ``left_s`` the time
        that remains by the estimate (``None``: unknown)."""

    def close(self) -> None: ...


class _Budget(Exception):
    """No time left for another trial."""


class Sweep:
    """One sweep over ``space`` (see the module docstring).

    Args:
        measure: runs a trial.
        settings: the sweep's settings (already checked).
        space: the batch sizes allowed.
        current: the user's setting (measured first), or ``None``.
        cuda: whether the run is on CUDA (``pin_memory`` matters only there).
        pin_memory: the loader's own ``pin_memory`` (``None``: unknown, not flipped).
        prefetch_factor: the loader's own ``prefetch_factor`` (``None``: torch's default, 2).
        progress: told after each trial.
        device: what the trials run on, for the result (``None``: unknown).
        notes: what the caller knows for the reader (the result's first notes).
    """

    def __init__(self, measure: Measure, settings: TuneSettings, space: BatchSpace, *,
                 current: Config | None = None, cuda: bool = False,
                 pin_memory: bool | None = None, prefetch_factor: int | None = None,
                 progress: Progress | None = None, device: str | None = None,
                 notes: list[str] | None = None) -> None:
        self._measure_fn = measure
        self.settings = settings
        self.space = space
        self.current_config = current
        self.cuda = cuda
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.progress = progress
        self.trials: list[Trial] = []
        self._seen: dict[Config, Trial] = {}
        self._spent = 0.0
        self._coarse_left = len(space.coarse())
        self.oom_batch: int | None = None
        self.device = device
        self.notes: list[str] = list(notes or [])
        self._ctrl_c = _CtrlC()

    # -- running ----------------------------------------------------------------------------
    def run(self) -> TuneResult:
        """Measure, choose, return the result (an exception from ``measure`` that is not an
        out-of-memory error propagates: it is the user's to see). Ctrl-C raises
        :class:`TuneInterrupted` with the result of the trials that finished."""
        start = time.monotonic()
        stopped = "done"
        current: Trial | None = None
        confirm: Trial | None = None
        try:
            with self._ctrl_c.watching():
                try:
                    if self.current_config is not None:
                        current = self._measure(self.current_config, "current")
                    self._coarse()
                    self._refine()
                    self._loader_options()
                except _Budget:
                    stopped = "budget"
                chosen = self._chosen()
                if chosen is not None and self.settings.confirm:
                    try:
                        confirm = self._measure(chosen.config, "confirm", again=True)
                    except _Budget:
                        stopped = "budget"
        except KeyboardInterrupt as exc:
            done = len(self.trials)
            self.notes.insert(0, f"interrupted (Ctrl-C) after {done} finished trial(s): a "
                              "partial sweep, the choice is the best of those trials")
            raise TuneInterrupted(self._result(start, current, confirm, "interrupted")) \
                from exc
        finally:
            if self.progress is not None:
                self.progress.close()
        return self._result(start, current, confirm, stopped)

    def _chosen(self) -> Trial | None:
        """:meth:`choose`, with a note on the faster trials it passed over."""
        chosen = self.choose()
        edge = [t for t in self.trials if t.ok and t.alloc_retries and chosen is not None
                and t.throughput > chosen.throughput]
        if edge:
            sizes = ", ".join(str(b) for b in sorted({t.config.batch_size for t in edge}))
            self.notes.append(f"batch {sizes} ran faster only with the allocator's retries "
                              "(the memory edge, where the next run may run out of memory): "
                              "not chosen")
        return chosen

    def _result(self, start: float, current: Trial | None, confirm: Trial | None,
                stopped: str) -> TuneResult:
        chosen = self.choose()
        if chosen is None and stopped == "done":
            stopped = "failed"
        fits = [t.config.batch_size for t in self.trials if t.ok]
        return TuneResult(trials=self.trials, chosen=chosen, current=current, confirm=confirm,
                          oom_batch=self.oom_batch, fits_batch=max(fits, default=None),
                          stopped=stopped, elapsed_s=time.monotonic() - start,
                          settings=self.settings, device=self.device, notes=self.notes,
                          world_size=self.space.world_size)

    def choose(self) -> Trial | None:
        """The winning trial (module docstring), among trials of the space."""
        pool = [t for t in self.trials if t.ok and t.role != "confirm"
                and self._in_space(t.config)]
        if not pool:
            return None
        clean = [t for t in pool if not t.alloc_retries]
        if clean:
            pool = clean  # a trial that needed the allocator's retries ran at the memory edge
        top = max(t.throughput for t in pool)
        close = [t for t in pool if t.throughput >= top * (1 - self.settings.tie_pct / 100)]
        return min(close, key=lambda t: (
            t.config.batch_size, t.config.num_workers,
            (t.config.pin_memory is not None) + (t.config.prefetch_factor is not None),
            -t.throughput))

    # -- the passes ---------------------------------------------------------------------------
    def _coarse(self) -> None:
        workers = self.settings.workers[0]
        best = 0.0
        declines = 0
        for b in self.space.coarse():
            self._coarse_left -= 1
            trial = self._at(b, workers, "coarse")
            if not trial.ok:
                self._stop_at(trial)
                return
            workers = trial.config.num_workers
            if trial.throughput > best * (1 + self.settings.tie_pct / 100):
                declines = 0
            elif trial.throughput < best * (1 - self.settings.tie_pct / 100):
                declines += 1
            best = max(best, trial.throughput)
            if declines >= self.settings.patience:
                self.notes.append(
                    f"the coarse pass stopped after batch {b}: {declines} batch sizes in a "
                    "row were slower than the best, so the out-of-memory edge was not sought")
                return
        self._coarse_left = 0

    def _refine(self) -> None:
        left = self.settings.refine_trials
        while left > 0:
            chosen = self.choose()
            if chosen is None:
                return
            b = chosen.config.batch_size
            mine = [t for t in self.trials if self._in_space(t.config)]
            tried = {t.config.batch_size for t in mine}
            below = [t.config.batch_size for t in mine if t.config.batch_size < b and t.ok]
            above = [s for s in tried if s > b]
            found = []
            if below:
                found.append(self.space.between(max(below), b))
            if above:
                found.append(self.space.between(b, min(above)))
            picks = [p for p in found if p is not None and p not in tried
                     and (self.oom_batch is None or p < self.oom_batch)]
            if not picks:
                return
            for p in picks[:left]:
                left -= 1
                trial = self._at(p, chosen.config.num_workers, "refine")
                if not trial.ok:
                    self._stop_at(trial)

    def _loader_options(self) -> None:
        if not self.settings.loader_options:
            return
        chosen = self.choose()
        if chosen is None:
            return
        c = chosen.config
        if self.cuda and self.pin_memory is not None and c.pin_memory is None:
            self._measure(Config(c.batch_size, c.num_workers, not self.pin_memory,
                                 c.prefetch_factor, c.accumulation), "loader")
        chosen = self.choose()
        if chosen is None:
            return
        c = chosen.config
        wait = chosen.data_wait_pct
        if (c.num_workers > 0 and wait is not None and wait >= self.settings.data_wait_pct
                and (self.prefetch_factor or 2) < 4):
            self._measure(Config(c.batch_size, c.num_workers, c.pin_memory, 4, c.accumulation),
                          "loader")

    def _at(self, b: int, workers: int, role: str) -> Trial:
        """The best trial at batch size ``b``: workers from ``workers`` up while the data wait
        is at or above the target and more workers help."""
        acc = self.space.accumulation(b)
        grid = self.settings.workers
        best = trial = self._measure(Config(b, workers, accumulation=acc), role)
        target = self.settings.data_wait_pct
        while trial.ok and trial.data_wait_pct is not None and trial.data_wait_pct >= target:
            more = [w for w in grid if w > trial.config.num_workers]
            if not more:
                break
            nxt = self._measure(Config(b, more[0], accumulation=acc), "workers")
            if not nxt.ok:
                break
            helped = nxt.throughput > best.throughput * (1 + self.settings.tie_pct / 100)
            if helped:
                best = nxt
            trial = nxt
            if not helped:
                break
        return best

    # -- bookkeeping --------------------------------------------------------------------------
    def _measure(self, config: Config, role: str, again: bool = False) -> Trial:
        if self._ctrl_c.pressed:
            raise KeyboardInterrupt  # one Python swallowed (:class:`_CtrlC`)
        if not again and config in self._seen:
            return self._seen[config]
        done = len(self.trials)
        if done and self.settings.budget_s is not None:
            mean = self._spent / done
            if self._spent + mean > self.settings.budget_s:
                self.notes.append(
                    f"the time budget ({self.settings.budget_s:g} s) ran out after {done} "
                    "trials")
                raise _Budget
        trial = self._measure_fn(config, role)
        trial.role = role
        self.trials.append(trial)
        self._seen.setdefault(config, trial)
        self._spent += trial.wall_s or 0.0
        if trial.status == "oom" and self._in_space(config):
            b = config.batch_size
            self.oom_batch = b if self.oom_batch is None else min(self.oom_batch, b)
        if self.progress is not None:
            expected = len(self.trials) + self._expected_left()
            mean = self._spent / len(self.trials)
            left = (expected - len(self.trials)) * mean
            if self.settings.budget_s is not None:
                left = min(left, max(0.0, self.settings.budget_s - self._spent))
            self.progress.update(trial, len(self.trials), expected, self._spent, left)
        return trial

    def _expected_left(self) -> int:
        """About how many trials are left (for the progress display only)."""
        coarse = self._coarse_left
        ok = [t for t in self.trials if t.ok and t.peak_reserved_gb is not None
              and t.total_gb is not None]
        if coarse and len(ok) >= 2 and self.oom_batch is None:
            a, b = sorted(ok, key=lambda t: t.config.batch_size)[-2:]
            db = b.config.batch_size - a.config.batch_size
            per = ((b.peak_reserved_gb or 0.0) - (a.peak_reserved_gb or 0.0)) / db if db else 0
            if per > 0 and b.total_gb is not None:
                fit = b.config.batch_size + ((b.total_gb - (b.peak_reserved_gb or 0)) / per)
                doublings = math.log2(max(fit, 1) / b.config.batch_size) if fit > 0 else 0
                coarse = min(coarse, max(0, math.ceil(doublings)) + 1)
        if self.oom_batch is not None:
            coarse = 0
        extra = self.settings.refine_trials + int(self.settings.loader_options) + int(
            self.settings.confirm)
        return coarse + extra

    def _stop_at(self, trial: Trial) -> None:
        if trial.status == "failed":
            self.notes.append(f"{trial.config.label()} could not be timed ({trial.error}); "
                              "larger batch sizes were not tried")

    def _in_space(self, c: Config) -> bool:
        return self.space.allowed(c.batch_size) and c.accumulation == self.space.accumulation(
            c.batch_size)


class _CtrlC:
    """A Ctrl-C during a sweep, kept even where Python loses its ``KeyboardInterrupt``: one
    that lands in a fork's after-fork hooks (a trial's loader workers starting) is printed as
    "Exception ignored" and dropped, and the sweep went on.  The handler notes the press, then
    raises as Python's own does; the sweep looks at the note before each trial."""

    def __init__(self) -> None:
        self.pressed = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed = True
        signal.default_int_handler(signum, frame)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Python's own SIGINT handler replaced by this one for the block; a handler of the
        user's own, or a sweep off the main thread, is left alone."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
