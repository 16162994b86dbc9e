"""Step anatomy: how a training step's time splits into waiting for data, forward+backward and
the optimizer, measured from framework hooks without ever synchronising the device.

A training loop (or a framework callback) marks the boundaries of each step on the training
thread::

    phases.resume()            # the step loop is about to fetch the next batch
    batch = next(it)
    phases.step_begin()        # batch in hand: forward+backward starts
    loss.backward()
    phases.before_optimizer()  # gradients ready: optimizer phase starts
    opt.step(); opt.zero_grad()
    phases.step_end()          # step done: the wait for the next batch starts

and at each log call reads :meth:`StepPhases.collect`, which returns

* ``perf/data_wait_pct``: the time from ``step_end`` (or the latest ``resume``) to the next
  ``step_begin``, as a percentage of the measured step time (data wait + forward/backward +
  optimizer) of the steps completed in the window;
* ``perf/forward_backward_pct`` and ``perf/optimizer_pct``: the same shares for the other two
  phases (``step_begin`` -> ``before_optimizer`` and ``before_optimizer`` -> ``step_end``; a step
  without ``before_optimizer`` counts wholly as forward/backward);
* ``perf/data_wait_s``, ``perf/forward_backward_s``, ``perf/optimizer_s``: seconds per optimizer
  step in the window (phase total divided by the ``steps`` passed to ``collect``).

Time between ``step_end`` and a later ``resume`` (logging, evaluation, checkpointing) is left out
of every phase and of the denominator.

**Two clocks.** On CPU the marks are ``time.perf_counter()`` readings of the training thread. With
``cuda=True`` each mark also records a CUDA event on the current stream, and the phases are
measured on the *GPU's* timeline: the data wait is then the time the GPU sat idle between the
last kernel of one step and the first of the next, which is what starves a GPU (while the host
runs ahead of a busy GPU it is ~0 even if the host spends time fetching). Events are read with
``Event.query()`` once they have completed, never with ``synchronize()``; steps whose events
have not completed at a ``collect`` are counted in a later window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["StepPhases"]

_BEGIN = "begin"
_OPT = "opt"
_END = "end"
_RESUME = "resume"

# (previous mark, this mark) -> phase that the interval between them belongs to
_PHASE_OF: dict[tuple[str, str], str] = {
    (_END, _BEGIN): "data_wait",
    (_RESUME, _BEGIN): "data_wait",
    (_BEGIN, _OPT): "forward_backward",
    (_BEGIN, _END): "forward_backward",
    (_OPT, _END): "optimizer",
}
_PHASES = ("data_wait", "forward_backward", "optimizer")

_MAX_PENDING = 4096
"""Marks kept while waiting for their CUDA events; older ones are dropped (and counted)."""
_MAX_FREE = 64
"""Completed device events kept for reuse."""


class StepPhases:
    """Times the phases of training steps from marks made on the training thread.

    Args:
        cuda: record CUDA events (on ``torch.cuda.current_stream()``) and measure on the GPU
            timeline; ``False`` uses the host clock. ``None`` (default): CUDA when torch is
            already imported and a CUDA device is available.
        event_factory: makes the device events when ``cuda`` is true (default:
            ``torch.cuda.Event(enable_timing=True)``); anything with ``record()``, ``query()``
            and ``elapsed_time(end)`` in milliseconds, e.g. another accelerator's events.

    Each mark costs a ``perf_counter`` call (plus one ``cudaEventRecord`` with ``cuda=True``;
    the events are reused once read, so none is created or destroyed per mark in steady state;
    the current stream is looked up without building a ``torch.cuda.Stream`` per mark:
    :func:`current_stream_lookup`). Not thread-safe: mark and collect from the training thread.
    """

    def __init__(self, cuda: bool | None = None,
                 event_factory: Callable[[], Any] | None = None) -> None:
        if cuda is None:
            cuda = _cuda_available()
        self.cuda = cuda
        default_events = cuda and event_factory is None
        if default_events:
            import torch

            def event_factory() -> Any:
                return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call,unused-ignore]

        self._new_event = event_factory
        self._stream: Callable[[], Any] | None = None
        """The current stream of torch's events (``None``: ``record()`` finds it itself)."""
        if default_events:
            self._stream = current_stream_lookup()
        self._pending: deque[tuple[int, str, Any]] = deque()
        """(sequence number, label, stamp) of each mark not yet read."""
        self._made = 0
        """Marks made so far (the next mark's sequence number)."""
        self._free: list[Any] = []
        """Device events read for the last time, recorded again by later marks (no event is
        made or destroyed per mark once a few steps have run)."""
        self._last: tuple[str, Any] | None = None
        self._totals = dict.fromkeys(_PHASES, 0.0)
        self._seen = dict.fromkeys(_PHASES, False)
        self.dropped = 0
        """Marks dropped because their CUDA events did not complete in time (bounded queue)."""

    # -- marks ---------------------------------------------------------------------------------
    def step_begin(self) -> None:
        """The batch is in hand; forward+backward starts (ends the data wait)."""
        self._mark(_BEGIN)

    def before_optimizer(self) -> None:
        """Gradients are ready; the optimizer step starts."""
        self._mark(_OPT)

    def step_end(self) -> None:
        """The optimizer step is done; waiting for the next batch starts."""
        self._mark(_END)

    def resume(self) -> None:
        """Restart the data-wait clock: what ran since ``step_end`` (logging, evaluation,
        checkpointing, an epoch boundary) counts in no phase."""
        self._mark(_RESUME)

    def _mark(self, label: str) -> None:
        if self._new_event is not None and self.cuda:
            event = self._free.pop() if self._free else self._new_event()
            if self._stream is not None:
                event.record(self._stream())
            else:
                event.record()
            stamp: Any = event
        else:
            stamp = time.perf_counter()
        if len(self._pending) >= _MAX_PENDING:
            self._pending.popleft()
            self._last = None
            self.dropped += 1
        self._pending.append((self._made, label, stamp))
        self._made += 1

    def cut(self) -> int:
        """Where a window ends, for a :meth:`collect` made later (``upto``): the marks made so
        far. A plain counter read: no device call."""
        return self._made

    # -- reading ---------------------------------------------------------------------------------
    def collect(self, steps: int, upto: int | None = None) -> dict[str, float]:
        """Phase figures of the steps completed since the previous ``collect``.

        Args:
            steps: optimizer steps in the window (for the per-step seconds); ``<= 0`` leaves the
                ``_s`` keys out.
            upto: a :meth:`cut` taken when the window ended: marks made after it are left for
                the next window (a row written later than its step ended, at a point where the
                host is ahead of the device, reads only its own steps). ``None``: every mark.

        Returns:
            ``perf/<phase>_pct`` and ``perf/<phase>_s`` for the phases that were observed; an
            empty dict when no complete interval was seen (never zeros for "unknown").
        """
        self._drain(upto)
        totals, seen = self._totals, self._seen
        self._totals = dict.fromkeys(_PHASES, 0.0)
        self._seen = dict.fromkeys(_PHASES, False)
        measured = sum(totals.values())
        out: dict[str, float] = {}
        for phase in _PHASES:
            if not seen[phase]:
                continue
            if measured > 0:
                out[f"perf/{phase}_pct"] = 100.0 * totals[phase] / measured
            if steps > 0:
                out[f"perf/{phase}_s"] = totals[phase] / steps
        return out

    def _drain(self, upto: int | None = None) -> None:
        while self._pending:
            seq, label, stamp = self._pending[0]
            if upto is not None and seq >= upto:
                return  # a later window's
            if self.cuda and not stamp.query():
                return  # later marks cannot have completed before this one
            self._pending.popleft()
            last = self._last
            if last is not None:
                phase = _PHASE_OF.get((last[0], label))
                if phase is not None:
                    self._totals[phase] += self._elapsed(last[1], stamp)
                    self._seen[phase] = True
                if self.cuda and len(self._free) < _MAX_FREE:
                    self._free.append(last[1])  # read for the last time: record it again later
            self._last = (label, stamp)

    def _elapsed(self, start: Any, end: Any) -> float:
        if self.cuda:
            return max(0.0, float(start.elapsed_time(end)) / 1000.0)
        return max(0.0, float(end) - float(start))


def current_stream_lookup() -> Callable[[], Any] | None:
    """``torch.cuda.current_stream()`` for the phase marks, cheaper: torch's builds a new
    ``Stream`` object in Python at every call (7.6 us of an ``Event.record()``'s 11.1 on an
    H100 host, where ``record(stream)`` took 3.5: ``benchmarks/results/2026-11-28-h100-mark-cost``),
    and the marks are made where the device waits for the host (Hugging Face's step hooks come
    after its per-step ``isnan(loss)`` sync). ``None`` when this torch lacks the two C calls
    it reads or they do not give what ``torch.cuda.current_stream()`` gives (checked once,
    here; then ``record()`` finds the stream itself)."""
    import torch

    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get_device is None or get_stream is None:
        return None
    lookup = stream_lookup(lambda: get_stream(get_device()), torch.cuda.current_stream)
    try:
        same = lookup() == torch.cuda.current_stream()
    except Exception:  # another torch's private calls: the public path, never an error
        return None
    return lookup if same else None


def stream_lookup(key: Callable[[], Any], build: Callable[[], Any],
                  keep: int = 8) -> Callable[[], Any]:
    """A function that returns ``build()``'s object for the current ``key()``, building it
    only for a key it has not seen (at most ``keep`` kept): the current CUDA stream as a
    ``torch.cuda.Stream``, rebuilt only when torch's current stream (a C call's tuple) changed,
    e.g. under a ``torch.cuda.stream(...)`` context."""
    known: dict[Any, Any] = {}

    def current() -> Any:
        k = key()
        found = known.get(k)
        if found is None:
            if len(known) >= keep:
                known.clear()
            found = known[k] = build()
        return found

    return current


def _cuda_available() -> bool:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install must not stop training
        return False
