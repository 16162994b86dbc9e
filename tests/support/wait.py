"""Waiting in tests on the event a test needs (a row arrived, a process exited, a file has N
lines) instead of sleeping for a fixed time and hoping.

``wait_until(predicate)`` polls ``predicate`` until it returns something truthy and returns
that; the timeout only bounds a hang (it is generous: a loaded machine with the suite in
several workers may take seconds for what takes milliseconds alone), and its failure says
what was awaited and what the predicate last gave.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


def wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S,
               interval: float = 0.01, what: str = "") -> T:
    """Call ``predicate`` every ``interval`` seconds until its result is truthy; return it.

    Raises ``AssertionError`` naming ``what`` (or the predicate) and its last result when
    ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            name = what or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"waited {timeout:.0f} s for {name}; last got {got!r}")
        time.sleep(interval)
