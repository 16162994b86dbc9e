"""Library logging: a ``NullHandler`` on the package logger and warnings once per cause."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("gpulens")
logger.addHandler(logging.NullHandler())

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> None:
    """Log ``message`` at WARNING the first time ``cause`` is seen in this process."""
    with _lock:
        if cause in _seen:
            return
        _seen.add(cause)
    logger.warning(message, *args)


def reset_warnings() -> None:
    """Forget which causes were warned about (tests)."""
    with _lock:
        _seen.clear()
