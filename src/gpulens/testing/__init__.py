"""Test doubles that are part of the public API: simulated GPUs and a sink that keeps rows.

Use them to test your own training code with gpulens on a machine without a GPU::

    from gpulens.testing import MemorySink, SimulatedNVML, Square

The simulated GPUs are the backend ``GPULENS_BACKEND=simulated`` runs on
(:mod:`gpulens.sources.simulated`, its loads in :mod:`gpulens.sources.loads`); with a load from
here (or a module-level function) they pickle, so they run in gpulens's engine process exactly
like real GPUs do.
"""

from gpulens.sources.loads import Constant, PerGpu, Square, Steps, Wave, default_load
from gpulens.sources.simulated import SimulatedNVML
from gpulens.testing.memory import MemorySink

__all__ = ["Constant", "MemorySink", "PerGpu", "SimulatedNVML", "Square", "Steps", "Wave",
           "default_load"]
