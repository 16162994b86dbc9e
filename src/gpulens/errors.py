"""The package's exceptions.

::

    GpulensError
     +-- NvmlUnavailable    no NVML library or driver (monitoring falls back to host metrics)
     +-- GpuLost            a GPU stopped answering mid-run (that GPU's metrics stop)

User errors (bad arguments, unknown sink, unwritable path) are plain ``ValueError``.
"""

from __future__ import annotations


class GpulensError(Exception):
    """Base class of gpulens's own errors."""


class NvmlUnavailable(GpulensError):
    """NVML could not be initialised: no driver, no library, or no permission."""


class GpuLost(GpulensError):
    """A GPU fell off the bus or stopped answering NVML."""
