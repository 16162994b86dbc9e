"""A simulated NVML that leaves a mark when an engine opens it: a test sees from outside
that an engine process got that far (the simulator is pickled into the engine process)."""

from __future__ import annotations

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
