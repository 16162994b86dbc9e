"""Test doubles that are part of the public API: simulated GPUs and a sink that keeps rows.

Use them to test your own training code with gpulens on a machine without a GPU::

    from gpulens.testing import SimulatedNVML, MemorySink
"""

from gpulens.testing.memory import MemorySink
from gpulens.testing.simulated import SimulatedNVML, default_load

__all__ = ["MemorySink", "SimulatedNVML", "default_load"]
