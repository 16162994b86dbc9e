"""Run a benchmark script's ``main(argv)`` in the test's own process, and leave nothing behind.

A fresh ``python benchmarks/X.py`` pays for importing torch, transformers and Lightning again
(about 5 s of CPU on this machine's two cores); a test worker has usually imported them
already. :func:`run_main` runs the script here instead and puts back what a script changes in
a process: the environment, the working directory, ``sys.argv`` and ``sys.path``; the level,
handlers, propagation and ``disabled`` flag of every logger that existed before (and
``logging.disable``); the warning filters (while the script runs they are a fresh
interpreter's: a warning is printed on stderr, not raised as the test suite's filter would);
torch's thread count and TF32 switch; the states of the random number generators (``random``,
numpy, torch); the handlers of SIGINT and SIGTERM; and the collector's frozen generation (a
``--quick`` run ``gc.freeze()``-s what is alive).

Modules it imported stay imported. So that a library's own logging set-up at import is not
undone as if it were the script's, gpulens and the libraries the script uses (``preload``)
are imported before the snapshot (the test fails if the script imported one of those that set
their logger up at import itself); the loggers the script quiets
(``overhead_gpu.quiet_libraries``) are made before it too, so their levels come back.

It then checks that the script left no thread and no child process running (waiting a while
for those that are ending): a script that leaves either is not run this way. Only for
scripts that start no ``torch.distributed`` group and leave no tracker's process-wide
setting behind (an MLflow tracking URI): those run in a subprocess.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import os
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

#: The loggers ``benchmarks/overhead_gpu.py``'s ``quiet_libraries`` sets to ERROR.
QUIETED = ("lightning", "lightning.pytorch", "pytorch_lightning", "mlflow", "wandb", "urllib3",
           "git", "transformers", "accelerate")
#: The warnings a fresh interpreter ignores (its other warnings it prints).
FRESH_IGNORED = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
#: Libraries that set their logger up when imported: a script that imports one needs it in
#: ``preload``.
SELF_CONFIGURING = ("lightning", "pytorch_lightning", "mlflow", "transformers")
LEFTOVER_WAIT_S = 30.0  # bounds the wait for the script's threads and processes to end


def _print_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: Any = None, line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _loggers() -> dict[str, logging.Logger]:
    out = {name: lg for name, lg in logging.Logger.manager.loggerDict.items()
           if isinstance(lg, logging.Logger)}
    out[""] = logging.getLogger()
    return out


@contextlib.contextmanager
def _restored_loggers() -> Iterator[None]:
    for name in QUIETED:
        logging.getLogger(name)
    saved = {name: (lg.level, lg.propagate, lg.disabled, list(lg.handlers))
             for name, lg in _loggers().items()}
    disabled = logging.root.manager.disable
    try:
        yield
    finally:
        logging.disable(disabled)
        loggers = _loggers()
        for name, (level, propagate, off, handlers) in saved.items():
            lg = loggers[name]
            lg.setLevel(level)
            lg.propagate, lg.disabled, lg.handlers = propagate, off, handlers


@contextlib.contextmanager
def _restored_state() -> Iterator[None]:
    """Everything :func:`run_main` puts back, but the loggers."""
    environ, cwd, argv, path = dict(os.environ), os.getcwd(), sys.argv[:], sys.path[:]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rng: list[tuple[Any, Any]] = [(random.setstate, random.getstate())]
    if "numpy" in sys.modules:
        numpy: Any = sys.modules["numpy"]
        rng.append((numpy.random.set_state, numpy.random.get_state()))
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        threads, tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
        rng.append((torch.set_rng_state, torch.get_rng_state()))
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters: printed, not raised
            for category in FRESH_IGNORED:
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _print_warning
            yield
    finally:
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:], sys.path[:] = argv, path
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for setter, state in rng:
            setter(state)
        if torch is not None:
            torch.set_num_threads(threads)
            torch.backends.cuda.matmul.allow_tf32 = tf32


def _leftovers(threads: set[threading.Thread], children: set[int]) -> list[str]:
    """Threads and child processes started since the snapshot that are still running after
    up to ``LEFTOVER_WAIT_S`` seconds (those that are ending get the time to end)."""
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while True:
        left = [f"thread {t.name}" for t in threading.enumerate()
                if t not in threads and t.is_alive()]
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.pid not in children and child.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"process {child.pid} {' '.join(child.cmdline())[:200]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def run_main(script: Path, argv: Sequence[str], cwd: Path, env: dict[str, str],
             preload: Sequence[str] = ()) -> str:
    """Run ``script``'s ``main(argv)`` in this process with ``env`` as the whole environment
    and ``cwd`` as the working directory; return what it printed on stdout. Fails the test
    when ``main`` returns non-zero or leaves a thread or a child process running."""
    for name in ("gpulens", *preload):  # gpulens sets its logger up at import
        importlib.import_module(name)
    threads = set(threading.enumerate())
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    modules = set(sys.modules)
    out = io.StringIO()
    with _restored_loggers(), _restored_state():
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv[:] = [str(script), *argv]
        sys.path.insert(0, str(script.parent))
        module = importlib.import_module(script.stem)
        with contextlib.redirect_stdout(out):
            rc = module.main(list(argv))
    assert rc in (0, None), f"{script.name} returned {rc}:\n{out.getvalue()[-4000:]}"
    late = [m for m in SELF_CONFIGURING if m in sys.modules and m not in modules]
    assert not late, f"{script.name} imported {late}: preload them (their logging set-up)"
    left = _leftovers(threads, children)
    assert not left, f"{script.name} left running: {left}"
    return out.getvalue()
