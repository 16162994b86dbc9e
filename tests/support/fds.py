"""File descriptors in tests: which of some numbers are open in this process."""

from __future__ import annotations

import os
from collections.abc import Iterable


def open_among(fds: Iterable[int]) -> list[int]:
    """Those of ``fds`` that are open file descriptors here (``fstat`` answers)."""
    found = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found
