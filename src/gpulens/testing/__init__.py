"""Test doubles that are part of the public API: simulated GPUs and a sink that keeps rows.

Use them to test your own training code with gpulens on a machine without a GPU::

    from gpulens.testing import MemorySink, SimulatedNVML, Square

Simulated GPUs with a load from :mod:`gpulens.testing.loads` (or a module-level function)
pickle, so they run in gpulens's sampler process exactly like real GPUs do.
"""

from gpulens.testing.loads import Constant, PerGpu, Square, Steps, Wave, default_load
from gpulens.testing.memory import MemorySink
from gpulens.testing.simulated import SimulatedNVML

__all__ = ["Constant", "MemorySink", "PerGpu", "SimulatedNVML", "Square", "Steps", "Wave",
           "default_load"]
