"""Load shapes for simulated GPUs (:mod:`gpulens.sources.simulated`): picklable, so a simulator
crosses into the engine process.  :mod:`gpulens.testing` exports them for tests.

A load is a callable ``load(gpu, t) -> activity`` with ``t`` in seconds since the simulator's
epoch (:attr:`gpulens.testing.SimulatedNVML.epoch`, a ``time.monotonic()`` reading, which is the
same clock in every process of the machine) and activity in [0, 1] (clamped by the simulator).
The shapes here are frozen dataclasses, so they pickle; a module-level function works too (it
pickles by name), a lambda or closure does not (then the monitor samples in a thread and says
so).

::

    SimulatedNVML(gpus=2, load=Square(period=0.6, high=1.0, low=0.0))   # busy/idle steps
    SimulatedNVML(gpus=1, load=Steps(((0.0, 0.0), (0.3, 1.0))))         # idle, then busy
    SimulatedNVML(gpus=2, load=PerGpu({1: Constant(0.1)}))               # GPU 1 nearly idle
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

LoadFn = Callable[[int, float], float]


@dataclass(frozen=True)
class Constant:
    """The same activity at every moment."""

    value: float

    def __call__(self, gpu: int, t: float) -> float:
        return self.value


@dataclass(frozen=True)
class Wave:
    """A slow sine wave with a phase per GPU (the default load): lively and deterministic."""

    mean: float = 0.55
    amplitude: float = 0.4
    period: float = 7.0
    """Seconds."""
    phase_per_gpu: float = 1 / 8
    """Fraction of a period between consecutive GPUs."""

    def __call__(self, gpu: int, t: float) -> float:
        return self.mean + self.amplitude * math.sin(
            2 * math.pi * (t / self.period + gpu * self.phase_per_gpu))


@dataclass(frozen=True)
class Square:
    """Alternating phases: ``low`` for ``period * (1 - duty)`` seconds, then ``high`` for
    ``period * duty`` seconds, starting at ``start`` (``low`` before it)."""

    period: float
    """Seconds of one low + high cycle."""
    high: float = 1.0
    low: float = 0.0
    duty: float = 0.5
    """Share of each period at ``high``."""
    start: float = 0.0

    def __call__(self, gpu: int, t: float) -> float:
        if t < self.start:
            return self.low
        phase = ((t - self.start) / self.period) % 1.0
        return self.high if phase >= 1.0 - self.duty else self.low


@dataclass(frozen=True)
class Steps:
    """Piecewise constant: ``points`` are ``(from t, activity)`` in time order; before the
    first point the activity is ``before``."""

    points: tuple[tuple[float, float], ...]
    before: float = 0.0

    def __call__(self, gpu: int, t: float) -> float:
        i = bisect_right([p[0] for p in self.points], t) - 1
        return self.points[i][1] if i >= 0 else self.before


@dataclass(frozen=True)
class PerGpu:
    """A load of its own for some GPUs; the others follow ``default``."""

    loads: Mapping[int, LoadFn]
    default: LoadFn = field(default_factory=Wave)

    def __call__(self, gpu: int, t: float) -> float:
        return self.loads.get(gpu, self.default)(gpu, t)


def default_load(gpu: int, t: float) -> float:
    """:class:`Wave` with its defaults (kept as a function for code that names it)."""
    return Wave()(gpu, t)
