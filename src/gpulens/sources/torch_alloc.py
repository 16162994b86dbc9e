"""The torch caching allocator's view of GPU memory, read without synchronizing the device.

Read only when this process has already imported torch *and* initialised CUDA: gpulens never
imports torch and never creates a CUDA context.  One call of
``torch.cuda.memory_stats_as_nested_dict`` reads the allocator's counters on the host (no
kernel, no sync); ``memory_allocated`` and ``max_memory_allocated`` would each build, flatten
and sort the whole statistics dictionary in Python.
"""

from __future__ import annotations

import sys
from typing import Any

_GB = 1e9


class TorchAllocator:
    """``read(index)`` gives (allocated GB, peak GB, allocation retries, OOMs) of torch device
    ``index``, or ``None``.

    The peak is torch's ``max_memory_allocated``: since the process started or since the
    training code last called ``torch.cuda.reset_peak_memory_stats`` (gpulens never resets it).
    Retries (``num_alloc_retries``: the allocator had to free its cache to satisfy a request)
    and OOMs (``num_ooms``) count since the process started.
    """

    def _cuda(self) -> Any | None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return None
        return cuda

    def read(self, index: int) -> tuple[float, float, float, float] | None:
        cuda = self._cuda()
        if cuda is None:
            return None
        try:
            stats = cuda.memory_stats_as_nested_dict(index)
            allocated = stats["allocated_bytes"]["all"]
            return (allocated["current"] / _GB, allocated["peak"] / _GB,
                    float(stats.get("num_alloc_retries", 0)), float(stats.get("num_ooms", 0)))
        except Exception:
            return None
