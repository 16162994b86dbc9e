"""One expensive run (a training launched as a user launches it) for several tests, once per
pytest session, whichever pytest-xdist workers those tests land on.

A module-scoped fixture alone is not enough under ``make test``: tests are dealt to the workers
one by one, so two tests that share a fixture often run in two workers, and each worker would
make the run again. (``xdist_group`` marks would keep them in one worker, but pytest-xdist 3.8
groups by rewriting ``item._nodeid``, which pytest 9.2 no longer reads: the marks are ignored.)

:func:`shared_run` keeps the run's folder beside the workers' temporary folders (all workers of a
session share their parent) and makes it under an exclusive ``flock``: the first test to ask
makes the run, a test that asks meanwhile waits for the lock, and every later one finds it
made. A run that failed is not made again: each test that asks fails with its message.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder all workers of this session share (the session's temporary folder)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str,
               make: Callable[[Path], None]) -> Path:
    """The folder ``shared-<name>`` in which ``make(folder)`` ran once for the session.

    ``make`` gets the empty folder and leaves there what the tests read; it fails with an
    exception (an ``AssertionError`` with the launched command's output, say)."""
    folder = shared_root(tmp_path_factory) / f"shared-{name}"
    # beside the folder, not in it: the tests see only what the run left
    made, failed = Path(f"{folder}.made"), Path(f"{folder}.failed")
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if made.exists():
            return folder
        if failed.exists():
            raise AssertionError(f"the shared run {name!r} failed in another test:\n"
                                 + failed.read_text())
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted run left
        folder.mkdir(parents=True)
        try:
            make(folder)
        except Exception:
            failed.write_text(traceback.format_exc()[-8000:])
            raise
        made.touch()
    return folder
