"""Simulated NVMLs that a test sees or steers from outside an engine process (the simulator
is pickled into it): one leaves a mark when an engine opens it, one holds its samples until a
file exists."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from gpulens.testing import SimulatedNVML


class MarkedNVML(SimulatedNVML):
    """:class:`~gpulens.testing.SimulatedNVML` that creates the file ``mark`` at ``nvmlInit``."""

    def __init__(self, mark: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mark = mark

    def nvmlInit(self) -> None:
        super().nvmlInit()
        Path(self.mark).touch()


class GatedNVML(SimulatedNVML):
    """:class:`~gpulens.testing.SimulatedNVML` whose clock reads and buffered samples (a
    sample's cheap and slow reads, never a start's look at the GPU) wait until the file
    ``gate`` exists, at most ``most_s``."""

    def __init__(self, gate: str, most_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate
        self.most_s = most_s
        self.gpm_sampled: list[float] = []
        """When each GPM sample was taken (``time.monotonic()``): never gated."""

    def _wait(self) -> None:
        deadline = time.monotonic() + self.most_s
        while not Path(self.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def nvmlDeviceGetClockInfo(self, h: Any, clock_type: int) -> int:
        self._wait()
        return super().nvmlDeviceGetClockInfo(h, clock_type)

    def nvmlDeviceGetSamples(self, h: Any, kind: int, since: int) -> Any:
        self._wait()
        return super().nvmlDeviceGetSamples(h, kind, since)

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> Any:
        self.gpm_sampled.append(time.monotonic())
        return super().nvmlGpmSampleGet(h, sample)


class LastGpuGated(GatedNVML):
    """:class:`GatedNVML` whose gate holds the last GPU's reads only: a reading stops half
    way, the first GPUs read and the last not. ``held`` is set once a read waits there (in
    this process: never pickled into an engine process)."""

    def __init__(self, gate: str, most_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(gate, most_s, **kwargs)
        self.held = threading.Event()

    def nvmlDeviceGetClockInfo(self, h: Any, clock_type: int) -> int:
        if h.index == self.gpus - 1:
            self.held.set()
            self._wait()
        return SimulatedNVML.nvmlDeviceGetClockInfo(self, h, clock_type)


class FirstReadFails(SimulatedNVML):
    """:class:`~gpulens.testing.SimulatedNVML` whose first clock read (the first sample's, never
    a start's look at the GPU) raises, as a driver fault would; later ones answer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed = False

    def nvmlDeviceGetClockInfo(self, h: Any, clock_type: int) -> int:
        if not self.failed:
            self.failed = True
            raise RuntimeError("simulated fault at the first sample")
        return super().nvmlDeviceGetClockInfo(h, clock_type)
