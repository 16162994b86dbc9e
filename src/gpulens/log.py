"""Library logging: the ``gpulens`` logger, heard by users who configured no logging at all.

* Everything gpulens says goes through ``logging.getLogger("gpulens")`` (and its children).
* A user who configured logging (a handler on the root logger: ``logging.basicConfig``,
  pytest, a framework) hears gpulens through that, once.  A user who configured nothing still
  hears WARNINGs and errors: the ``gpulens`` logger has a stderr handler of its own that speaks
  only while the root logger has no handler (as ``logging.lastResort`` would, which a
  ``NullHandler`` silences), formatted ``gpulens: WARNING: ...``.
* ``GPULENS_VERBOSITY`` (``debug``, ``info``, ``warning``, ``error``, ``critical``) or
  :func:`set_verbosity` set the ``gpulens`` logger's level; the default is the library default
  (WARNING unless the application sets another).
* :func:`warn_once` logs a WARNING once per cause, per process.
* In the engine process (:mod:`gpulens.transport.process`) the stderr handler is off and
  every record goes down the pipe instead (:class:`ForwardHandler`); the training process
  hands it to its own ``gpulens`` logger (:func:`reemit`), at the same level: the user hears
  the engine exactly as if it ran in their process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("gpulens")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}

NOTICE = 25
"""Between INFO and WARNING: what the user must hear to use what they asked for (the address of
a page gpulens serves), no fault.  Heard by default like a WARNING (``gpulens: <message>``);
silenced with the WARNINGs (``GPULENS_VERBOSITY=error``).  See :func:`say`."""
logging.addLevelName(NOTICE, "NOTICE")


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, at :data:`NOTICE` and above, only while the application configured no root
    handler (then the record reaches the user through the root logger instead, once)."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(NOTICE)
        self.setFormatter(_Formatter())
        self.enabled = True

    @property
    def stream(self) -> Any:  # the sys.stderr of the moment (pytest and others swap it)
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not self.enabled or logging.getLogger().handlers:
            return
        super().emit(record)


class _Formatter(logging.Formatter):
    """``gpulens: WARNING: <message>`` (messages start with ``gpulens:`` already, for users
    who read them through their own handlers); on a terminal, wrapped at its width between
    words (:func:`fit_terminal`)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage().removeprefix("gpulens: ")
        level = "" if record.levelno == NOTICE else f"{record.levelname}: "
        return fit_terminal(f"gpulens: {level}{text}", sys.stderr)


def fit_terminal(text: str, stream: Any) -> str:
    """``text`` as it should be written to ``stream``: unchanged unless ``stream`` is a
    terminal, else wrapped at the terminal's width between words (the terminal itself would
    cut words in two), the lines after the first indented by two spaces.  One message stays
    one message: no line of it is a new one."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return text
    if not tty:
        return text
    import textwrap

    width = 0
    with contextlib.suppress(ValueError):  # COLUMNS first, as shutil.get_terminal_size
        width = int(os.environ.get("COLUMNS", "0"))
    if width <= 0:  # then the size of this stream's terminal (stdout may be a file)
        try:
            width = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return text
    if width < 20:
        return text
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False) for line in text.splitlines())


_default_handler = _DefaultHandler()
logger.addHandler(_default_handler)


def _env_level() -> int | None:
    raw = os.environ.get("GPULENS_VERBOSITY", "").strip().lower()
    if not raw:
        return None
    if raw not in _LEVELS:
        logger.warning("gpulens: GPULENS_VERBOSITY=%r is not one of %s; ignored", raw,
                       ", ".join(_LEVELS))
        return None
    return _LEVELS[raw]


def set_verbosity(level: int | str) -> None:
    """Set the ``gpulens`` logger's level (``"info"``, ``logging.ERROR``, ...)."""
    if isinstance(level, str):
        if level.strip().lower() not in _LEVELS:
            raise ValueError(f"verbosity {level!r}: expected one of {', '.join(_LEVELS)}")
        level = _LEVELS[level.strip().lower()]
    logger.setLevel(level)


_level = _env_level()
if _level is not None:
    logger.setLevel(_level)

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> None:
    """Log ``message`` at WARNING the first time ``cause`` is seen in this process."""
    with _lock:
        if cause in _seen:
            return
        _seen.add(cause)
    logger.warning(message, *args)


def say(message: str, *args: object) -> None:
    """Tell the user what they need to use what they asked for (the address of a page gpulens
    serves): a :data:`NOTICE` record of the ``gpulens`` logger, heard as a WARNING would be
    (``gpulens: <message>`` on stderr, or through the application's own handlers), also from
    the engine process.  It is no warning, yet unheard it is lost.  Silent when the
    ``gpulens`` logger is set above WARNING (``GPULENS_VERBOSITY=error``)."""
    if not _hears_notices(logger):
        return
    logger.handle(logger.makeRecord(logger.name, NOTICE, "(gpulens)", 0, message, args, None))


def _hears_notices(target: logging.Logger) -> bool:
    """A logger set no quieter than WARNING hears :data:`NOTICE` (the library default leaves
    the ``gpulens`` logger at WARNING, which would drop a level below it)."""
    return target.getEffectiveLevel() <= logging.WARNING


def reset_warnings() -> None:
    """Forget which causes were warned about (tests)."""
    with _lock:
        _seen.clear()


# -- across the process boundary -------------------------------------------------------------
LogPayload = tuple[str, int, str, float]
"""(logger name, level number, formatted message, creation time): a record as it crosses."""


class ForwardHandler(logging.Handler):
    """Sends every record of the ``gpulens`` loggers to ``send`` (the engine process's end of
    the pipe), formatted there: arguments need not pickle."""

    def __init__(self, send: Callable[[LogPayload], object]) -> None:
        super().__init__(logging.DEBUG)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # the pipe is gone: nobody is left to tell
            self._send((record.name, record.levelno, record.getMessage(), record.created))


def forward_records(send: Callable[[LogPayload], object], level: int) -> ForwardHandler:
    """In the engine process: stop writing to stderr, send every record at ``level`` and
    above to the training process instead."""
    _default_handler.enabled = False
    handler = ForwardHandler(send)
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def reemit(payload: LogPayload) -> None:
    """In the training process: hand a record from the engine process to the logger of the
    same name, at its level (it reaches the user once, by whatever handlers they set)."""
    name, levelno, message, created = payload
    target = logging.getLogger(name)
    if not (target.isEnabledFor(levelno) or (levelno == NOTICE and _hears_notices(target))):
        return
    record = target.makeRecord(name, levelno, "(gpulens engine process)", 0, message, (),
                               None)
    record.created = created
    target.handle(record)


def effective_level() -> int:
    """The level below which the ``gpulens`` logger drops records here (sent to the engine
    process, so it forwards only what would be heard)."""
    return logger.getEffectiveLevel()


class Laps:
    """Seconds between named points of one piece of work (a start), said once at DEBUG:
    ``gpulens: <what> (s): a 0.011, b 0.200, total 0.211``. Costs two clock reads a point,
    and nothing more where DEBUG is off."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._on = logger.isEnabledFor(logging.DEBUG)
        self._last = self._first = time.perf_counter() if self._on else 0.0
        self._laps: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """The work since the last mark (or the start) was ``name``."""
        if self._on:
            now = time.perf_counter()
            self._laps.append((name, now - self._last))
            self._last = now

    def say(self) -> None:
        if self._on:
            parts = ", ".join(f"{name} {s:.3f}" for name, s in self._laps)
            logger.debug("gpulens: %s (s): %s, total %.3f", self.what, parts,
                         self._last - self._first)


ONE_LINE_CHARS = 300
""":func:`one_line` keeps at most about this many characters of an exception's text."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: its own text for a user error (``ValueError``, an install
    hint's ``ImportError``), ``Type: text`` otherwise. A text longer than
    :data:`ONE_LINE_CHARS` keeps its head and its tail, where a chained error says its cause
    (an MLflow server that is down: urllib3's "Connection refused" comes last)."""
    text = " ".join(str(exc).split())
    if len(text) > ONE_LINE_CHARS:
        text = f"{text[:ONE_LINE_CHARS // 2]} ... {text[-(ONE_LINE_CHARS // 2 - 5):]}"
    if isinstance(exc, (ValueError, ImportError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
