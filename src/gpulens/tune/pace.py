"""The loader's own pace: how long a loader worker takes per batch, measured in the workers.

A trial's timed window can run on batches its loader made before the window opened: while a
slow warm-up step runs (a compile, a slow rank, a loaded machine), the workers fill their
prefetch queue (``num_workers x prefetch_factor`` batches), and a short window eats those
before it has to wait. It then understates the data wait of a loader that cannot keep up
(``docs/design-notes.md``, "Tuning batch size and loader workers").

:class:`LoaderPace` removes that bias where the tuner builds the loader (a rebuilt
``DataLoader``, the Hugging Face Trainer's): the trial's collate function is wrapped
(:class:`TimedCollate`) so each worker notes, in shared memory, when it begins and finishes
each batch. To note the beginning, on its first batch the worker wraps, in its own process
only, the ``fetch`` of torch's dataset fetchers (the worker loop calls it as soon as an index
comes; it reads the samples, then calls the collate function). From a worker's second batch on,
finish less start is that batch's service time: the worker's own time for it, with no wait for
an index in it. The mean service time of the trial's batches begun before the window closed is
``b``, the time per batch (:func:`batch_s`). So ``k x b / workers - busy`` (``k`` batches an
optimizer step, ``busy`` the step less its measured wait) is the wait the loader imposes once
its queue is empty: zero or less for a loader that keeps up, the steady shortfall for one that
cannot.
:meth:`LoaderPace.correct` takes that where it is clearly larger than the wait the window
measured (by more than :data:`MARGIN` of the step), and recomputes the step time and the
rates from it (``Trial.data_wait_by`` says which one counted).

Where no start was noted (a torch whose fetchers are not where this looks), the gaps between
the batches a worker finished stand in: a gap is ``b`` when the worker cannot keep up (its next
index is always waiting) and longer when it waits for indices, so their lower quartile reads
``b``; but a worker that keeps up has gaps of the steps that freed its queue, which are not the
steps the window timed, and a few of them under uneven steps can read as a slow loader.

What this needs from the workers: two ``time.perf_counter()`` calls and three stores into
shared memory per batch. ``perf_counter`` reads ``CLOCK_MONOTONIC`` on Linux, the same clock in
every process of the host, so the workers' times and the window's edges compare.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

CAPACITY = 256
"""Batch times kept per worker (the latest; a timed window holds far fewer)."""


_began = [math.nan]
"""In a loader worker whose fetchers are wrapped (:func:`_time_fetches`): when the batch being
made now began (``perf_counter`` seconds; NaN once taken)."""
_wrapped: list[bool] = []
"""In a loader worker: :func:`_time_fetches` ran (one element)."""


def _time_fetches() -> None:
    """Wrap, in this process (a loader worker), the ``fetch`` of torch's dataset fetchers so
    each notes when it began in :data:`_began`.  Once a process; what cannot be wrapped is
    left as it is (the gaps then stand in)."""
    if _wrapped:
        return
    _wrapped.append(True)
    from torch.utils.data._utils import fetch as fetchers

    for cls in (getattr(fetchers, "_MapDatasetFetcher", None),
                getattr(fetchers, "_IterableDatasetFetcher", None)):
        original = cls.__dict__.get("fetch") if isinstance(cls, type) else None
        if original is None or getattr(original, "gpulens_timed", False):
            continue

        def timed(self: Any, index: Any, _original: Any = original) -> Any:
            _began[0] = time.perf_counter()
            return _original(self, index)

        timed.gpulens_timed = True  # type: ignore[attr-defined]
        setattr(cls, "fetch", timed)  # noqa: B010


class TimedCollate:
    """``collate`` that notes, in a loader worker, when it began and finished each batch."""

    def __init__(self, collate: Callable[[Any], Any], times: Any, counts: Any,
                 workers: int, began: Any = None) -> None:
        self.collate = collate
        self.times = times
        self.counts = counts
        self.workers = workers
        self.began = began

    def __getattr__(self, name: str) -> Any:
        # what reads the collator's own attributes (a Trainer subclass's
        # ``self.data_collator.tokenizer``) still finds them; never while unpickling
        if name.startswith("__") or name in ("collate", "times", "counts", "workers", "began"):
            raise AttributeError(name)
        return getattr(self.collate, name)

    def __call__(self, samples: Any) -> Any:
        start, _began[0] = _began[0], math.nan
        batch = self.collate(samples)
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        # a loader with other workers than the pace's (a Trainer subclass's own loader) is
        # not noted: its gaps would be read against the wrong count
        if info is not None and info.num_workers == self.workers and 0 <= info.id < self.workers:
            n = self.counts[info.id]
            at = info.id * CAPACITY + n % CAPACITY
            self.times[at] = time.perf_counter()
            if self.began is not None:
                self.began[at] = start
                if not _wrapped:  # this worker's first batch: its starts from the next on
                    try:
                        _time_fetches()
                    except Exception:  # another torch: the gaps stand in
                        self.began = None
            self.counts[info.id] = n + 1
        return batch


class LoaderPace:
    """The batch times of one trial's loader workers (module docstring).

    Args:
        workers: the loader's ``num_workers`` (at least 1). The shared memory is a
            ``multiprocessing`` ``RawArray``: it reaches the workers whatever their start
            method (fork, spawn, forkserver).
    """

    def __init__(self, workers: int) -> None:
        # here: importing multiprocessing names __mp_main__, which the core's import does not
        from multiprocessing.sharedctypes import RawArray

        if workers < 1:
            raise ValueError("LoaderPace needs loader workers")
        self.workers = workers
        self._times = RawArray("d", workers * CAPACITY)
        self._began = RawArray("d", [math.nan] * (workers * CAPACITY))
        self._counts = RawArray("q", workers)

    def wrap(self, collate: Callable[[Any], Any]) -> TimedCollate:
        """``collate`` timed in the workers; pass it as the loader's ``collate_fn``."""
        return TimedCollate(collate, self._times, self._counts, self.workers, self._began)

    def batches(self) -> tuple[list[list[float]], list[list[float]]]:
        """Each worker's batch finish times (``perf_counter`` seconds), oldest first, and when
        each of those batches began (NaN where it was not noted: a worker's first)."""
        finished: list[list[float]] = []
        began: list[list[float]] = []
        for w in range(self.workers):
            n = int(self._counts[w])  # once: the two lists match
            at = [w * CAPACITY + i % CAPACITY for i in range(n - min(n, CAPACITY), n)]
            finished.append([self._times[i] for i in at])
            began.append([self._began[i] for i in at])
        return finished, began

    def batch_s(self, t0: float, t1: float) -> float | None:
        """A worker's seconds per batch for the window ``[t0, t1]`` (:func:`batch_s`)."""
        finished, began = self.batches()
        return batch_s(finished, t0, t1, began)

    def correct(self, figures: dict[str, Any], t0: float, t1: float,
                batches_per_step: int, target_pct: float | None = None) -> dict[str, Any]:
        """``figures`` (a trial's) with the data wait the loader's pace imposes, where that is
        more than the window measured (module docstring); adds ``loader_batch_s`` and
        ``data_wait_by``."""
        return corrected(figures, self.batch_s(t0, t1), self.workers, batches_per_step,
                         target_pct)


QUANTILE = 0.25
"""Which of the gaps is read (the lower quartile, module docstring)."""
MIN_SERVICES = 1
"""Service times needed to read ``b`` from them (else the gaps): one batch's own time is a
measurement of it, where a gap is a measurement only when the worker was busy."""


def batch_s(finished: Sequence[Sequence[float]], t0: float, t1: float,
            began: Sequence[Sequence[float]] | None = None) -> float | None:
    """A worker's seconds per batch by ``t1``: the mean service time (finish less start,
    ``began`` beside ``finished``) of every noted batch that began before the window closed
    (service times hold no wait, so the batches made in the warm-up count as well as those of
    the window: a three-step window holds two or three, and one slow batch among so few would
    set the pace), where there are at least :data:`MIN_SERVICES`; else the gaps' lower quartile
    in ``[t0, t1]`` (below), ``None`` where neither is there. (A batch begun before ``t1`` is
    noted once it finished: the tuner reads this after the trial's workers ended.)

    The gaps: the lower quartile of the gaps between two batches one worker finished, both in
    ``[t0, t1]`` (over all workers); ``None`` with fewer than two gaps a worker (a handful of
    gaps of a loader that keeps up are a handful of steps, and a jittery step's quartile can
    pass for a slow loader).

    A gap is never shorter than the worker's time for the second batch. A worker that cannot
    keep up has every gap about that long; one that keeps up waits for indices, which come
    unevenly (a Trainer fetches a step's micro-batches back to back, an epoch's end restarts
    the workers), so its gaps mix its time per batch with steps and restarts: a low quantile
    reads the time per batch, where the median would read a step or a restart."""
    if began is not None:
        services = [f - b for times, starts in zip(finished, began, strict=True)
                    for f, b in zip(times, starts, strict=True)
                    if math.isfinite(b) and b <= t1 and b <= f]
        if len(services) >= MIN_SERVICES:
            return sum(services) / len(services)
    gaps: list[float] = []
    for times in finished:
        inside = [t for t in times if t0 <= t <= t1]
        gaps += [b - a for a, b in itertools.pairwise(inside)]
    if not gaps or len(gaps) < 2 * len(finished):
        return None
    gaps.sort()
    return gaps[int(QUANTILE * (len(gaps) - 1))]


MARGIN = 0.02
"""The paced wait replaces the timed one when longer by more than this share of the step
(where they agree, the window's figure stands), or when it reaches the sweep's data-wait
target and the timed one does not (a loader just short of the target is not missed)."""

_RATES = ("samples_per_s", "tokens_per_s", "tflops", "mfu_pct")
_PHASES = ("data_wait", "forward_backward", "optimizer")


def corrected(figures: dict[str, Any], per_batch_s: float | None, workers: int,
              batches_per_step: int, target_pct: float | None = None) -> dict[str, Any]:
    """``figures`` with ``data_wait_s`` raised to ``batches_per_step x per_batch_s / workers``
    less the step's busy time, when that is larger by more than :data:`MARGIN` of the step or
    reaches ``target_pct`` (the sweep's data-wait target, %) where the timed wait does not,
    and the step time, rates and phase shares recomputed from it (module docstring).
    ``seconds`` stays the window as timed."""
    out = dict(figures)
    out["loader_batch_s"] = per_batch_s
    out["data_wait_by"] = "window"
    step, wait = figures.get("step_s"), figures.get("data_wait_s")
    if per_batch_s is None or step is None or wait is None or step <= 0:
        return out
    busy = max(0.0, step - wait)
    paced = batches_per_step * per_batch_s / workers - busy
    if paced <= wait:
        return out
    new = dict(out, step_s=busy + paced, data_wait_s=paced, data_wait_by="loader pace")
    for key in _RATES:
        if out.get(key) is not None:
            new[key] = out[key] * step / (busy + paced)
    phase_s = {p: new.get(f"{p}_s") for p in _PHASES}
    total = sum(v for v in phase_s.values() if v is not None)
    if total > 0:
        for p, v in phase_s.items():
            if v is not None:
                new[f"{p}_pct"] = 100.0 * v / total
    # the target compared on the shares the report shows, before and after
    timed_pct = figures.get("data_wait_pct", 100 * wait / step)
    paced_pct = new.get("data_wait_pct", 100 * paced / (busy + paced))
    crosses = target_pct is not None and paced_pct >= target_pct > timed_pct
    return new if paced - wait > MARGIN * step or crosses else out
