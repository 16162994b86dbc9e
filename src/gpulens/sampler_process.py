"""The sampler in a process of its own, so that monitoring takes nothing from training.

In the training process, a sampler thread competes with the training thread for the GIL: each
time it wakes it waits for the interpreter, then holds it while it reads and finishes rows,
and a tracker client (MLflow's is pure Python, ~20 ms of CPU a row) holds it longer.  With
``Monitor(isolation="process")`` (the default where it can be used) the training process keeps
only this:

* ``log()`` pickles the mark (step, time, scalars) and writes it to a pipe without blocking:
  a few microseconds, no thread woken in this process;
* once a slow period, ``log()`` also reads the torch allocator's counters (one host-side call),
  which another process cannot see;
* a link thread that sleeps in ``os.read`` and wakes only for what must happen here: rows for
  the sinks that live in this process (W&B, whose run object is here; a framework's loggers;
  Prometheus; objects without a ``remote_spec``) and for the distributed gather.

The sampler process (``python -c "...sampler_process.main(...)"``) runs an ordinary thread-mode
:class:`~gpulens.Monitor` over the sinks that can be rebuilt there (JSONL, MLflow: their
``remote_spec()``), and sends the other rows back.  It ignores SIGINT (the training process
decides when to stop) and stops by itself, writing what it holds, when the training process
goes away (end of file on the pipe).

Messages, training process -> sampler process: the config (first), ``("m", step, t, wall,
scalars, alloc)``, ``("latest", n)``, ``("stop", timeout)``.  Back: ``("ready", context,
torch indices)`` or ``("error", kind, text)``, ``("row", row)``, ``("latest", n, values)``,
``("stopped", sink stats)``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulens._warn import logger, warn_once
from gpulens.link import LinkClosed, Receiver, Sender
from gpulens.sampler import Mark, _to_float
from gpulens.sinks.base import Row, RunContext, Sink
from gpulens.steplogger import SinkStats

READY_TIMEOUT_S = 120.0
"""How long ``start()`` waits for the sampler process to open NVML and its sinks (importing
MLflow can take seconds on a loaded machine)."""
_CHILD = "import sys; from gpulens.sampler_process import main; sys.exit(main(sys.argv[1:]))"
POLL_S = 0.02
"""How often the sampler process looks for step marks (they wait at least 0.2 s for the data
that closes their window anyway)."""
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20


class SpawnFailed(Exception):
    """The sampler process could not be started (not a user error: fall back to a thread)."""


def remote_spec(sink: Sink) -> tuple[str, dict[str, Any]] | None:
    """``("module:Class", kwargs)`` that rebuild ``sink`` in another process, or ``None``."""
    method = getattr(sink, "remote_spec", None)
    if method is None:
        return None
    spec: tuple[str, dict[str, Any]] | None = method()
    return spec


def _build(spec: tuple[str, dict[str, Any]]) -> Sink:
    target, kwargs = spec
    module_name, _, cls_name = target.partition(":")
    cls: Any = getattr(importlib.import_module(module_name), cls_name)
    sink: Sink = cls(**kwargs)
    return sink


def _plain(scalars: dict[str, Any]) -> bool:
    for value in scalars.values():
        if type(value) is not float and type(value) is not int:
            return False
    return True


class SamplerProcess:
    """The training process's end: spawns the sampler process and talks to it."""

    def __init__(self, config: dict[str, Any], on_row: Callable[[Row], None]) -> None:
        self._config = config
        self._on_row = on_row
        self._proc: subprocess.Popen[bytes] | None = None
        self._tx: Sender | None = None
        self._rx: Receiver | None = None
        self._reader: threading.Thread | None = None
        self._startup: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._replies: dict[int, dict[str, float]] = {}
        self._reply_ready = threading.Condition()
        self._latest_seq = 0
        self._stopped = threading.Event()
        self._child_stats: dict[str, SinkStats] = {}
        self._stopping = False
        self._relay: queue.SimpleQueue[Mark | None] | None = None
        self._relay_thread: threading.Thread | None = None
        self.context: RunContext | None = None
        self.torch_indices: list[int] = []

    # -- start -------------------------------------------------------------------------------
    def start(self) -> RunContext:
        """Spawn, send the config, wait until the process is sampling.

        ``ValueError`` for a user error found there (no such GPU, a sink that cannot open);
        :class:`SpawnFailed` when the process could not be started at all.
        """
        if not sys.executable:
            raise SpawnFailed("no Python executable to start (sys.executable is empty)")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        for fd in (to_child_w, from_child_w):
            with contextlib.suppress(OSError):
                import fcntl

                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        env = dict(os.environ)
        # The child imports this very gpulens, wherever the parent found it.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env,
                close_fds=True,
            )
        except OSError as exc:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise SpawnFailed(f"could not start the sampler process: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.close(to_child_r)
            with contextlib.suppress(OSError):
                os.close(from_child_w)
        self._tx = Sender(to_child_w, blocking=False)
        self._rx = Receiver(from_child_r)
        self._reader = threading.Thread(target=self._read_loop, name="gpulens-link",
                                        daemon=True)
        self._reader.start()
        self._tx.send(self._config)
        try:
            got = self._startup.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            self._kill()
            raise SpawnFailed(f"the sampler process did not start within "
                              f"{READY_TIMEOUT_S:.0f} s") from None
        if got[0] == "ready":
            self.context, self.torch_indices = got[1], list(got[2])
            return self.context
        self._kill()
        if got[0] == "error" and got[1] == "ValueError":
            raise ValueError(got[2])
        if got[0] == "error":
            raise SpawnFailed(f"the sampler process failed: {got[1]}: {got[2]}")
        code = self._proc.poll() if self._proc is not None else None
        raise SpawnFailed(f"the sampler process ended before it started (exit code {code})")

    # -- the link thread -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        rx = self._rx
        assert rx is not None
        started = False
        try:
            while True:
                msg = rx.recv()
                kind = msg[0]
                if kind == "row":
                    try:
                        self._on_row(msg[1])
                    except Exception as exc:
                        warn_once("link-row", "gpulens: could not hand a row on: %r", exc)
                elif kind == "latest":
                    with self._reply_ready:
                        self._replies[msg[1]] = msg[2]
                        self._reply_ready.notify_all()
                elif kind == "stopped":
                    self._child_stats = msg[1]
                    self._stopped.set()
                elif kind in ("ready", "error") and not started:
                    started = kind == "ready"
                    self._startup.put(msg)
        except LinkClosed:
            pass
        except Exception as exc:
            warn_once("link-read", "gpulens: reading from the sampler process failed: %r", exc)
        finally:
            if not started:
                self._startup.put(("dead",))
            elif not self._stopping:
                code = self._proc.poll() if self._proc is not None else None
                logger.warning("gpulens: the sampler process ended (exit code %s); GPU rows "
                               "stop, training goes on", code)
            self._stopped.set()

    # -- training thread ---------------------------------------------------------------------
    def mark(self, step: int, t: float, wall: float, scalars: dict[str, Any],
             alloc: dict[int, tuple[float, float]] | None) -> None:
        """Send a step mark (training thread; never blocks).  Scalars that are not plain
        numbers (tensors) are converted in a relay thread, which then sends every later mark
        too, in order."""
        if self._relay is None and _plain(scalars):
            tx = self._tx
            if tx is not None and not tx.send(("m", step, t, wall, scalars, alloc)):
                self._warn_unsent(tx)
            return
        mark = Mark(step, t, wall, scalars, alloc)
        if self._relay is None:
            self._relay = queue.SimpleQueue()
            self._relay_thread = threading.Thread(target=self._relay_loop,
                                                  name="gpulens-relay", daemon=True)
            self._relay_thread.start()
        self._relay.put(mark)

    def _send_mark(self, mark: Mark) -> None:
        tx = self._tx
        if tx is None:
            return
        if not tx.send(("m", mark.step, mark.t, mark.wall, mark.scalars, mark.alloc)):
            self._warn_unsent(tx)

    @staticmethod
    def _warn_unsent(tx: Sender) -> None:
        if tx.closed:
            warn_once("link-closed", "gpulens: the sampler process is gone; GPU rows stop, "
                      "training goes on")
        else:
            warn_once("link-full", "gpulens: the sampler process is not keeping up; step "
                      "marks are dropped (counted)")

    def _relay_loop(self) -> None:
        relay = self._relay
        assert relay is not None
        while True:
            mark = relay.get()
            if mark is None:
                return
            scalars: dict[str, float] = {}
            for name, value in mark.scalars.items():
                number = _to_float(value)
                if number is not None:
                    scalars[name] = number
            mark.scalars = scalars
            self._send_mark(mark)

    @property
    def dropped_marks(self) -> int:
        return self._tx.dropped if self._tx is not None else 0

    # -- live view -----------------------------------------------------------------------------
    def latest(self, timeout: float = 2.0) -> dict[str, float]:
        """The sampler process's newest sample of each metric (``{}`` if it does not answer)."""
        tx = self._tx
        if tx is None:
            return {}
        with self._reply_ready:
            self._latest_seq += 1
            seq = self._latest_seq
        tx.send(("latest", seq))
        deadline = time.monotonic() + timeout
        with self._reply_ready:
            while seq not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped.is_set():
                    return {}
                self._reply_ready.wait(left)
            return self._replies.pop(seq)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float) -> dict[str, SinkStats]:
        """Send what is queued and ``stop``; wait for the last rows and the sinks' figures."""
        self._stopping = True
        deadline = time.monotonic() + timeout + 5.0
        if self._relay is not None and self._relay_thread is not None:
            self._relay.put(None)
            self._relay_thread.join(max(0.0, deadline - time.monotonic()))
        tx = self._tx
        if tx is not None and not tx.closed:
            tx.send(("stop", timeout))
            while tx.pending_bytes and not tx.closed and time.monotonic() < deadline:
                time.sleep(0.002)
                tx.flush()
        if not self._stopped.wait(max(0.0, deadline - time.monotonic())):
            warn_once("child-stuck", "gpulens: the sampler process did not stop in %.0f s",
                      timeout + 5.0)
        if self._reader is not None:
            self._reader.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._kill(grace=max(0.5, deadline - time.monotonic()))
        return self._child_stats

    def _kill(self, grace: float = 0.0) -> None:
        if self._tx is not None:
            self._tx.close()
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        if self._rx is not None and (self._reader is None
                                     or not self._reader.is_alive()):
            self._rx.close()


# -- the sampler process's side ----------------------------------------------------------------
class LinkSink:
    """In the sampler process: sends rows back to the training process."""

    def __init__(self, tx: Sender) -> None:
        self._tx = tx

    def open(self, context: RunContext) -> None:
        pass

    def write(self, row: Row) -> None:
        # A training process that is gone takes nothing more: the row has nowhere to go.
        self._tx.send(("row", row))

    def close(self) -> None:
        pass


def main(argv: list[str]) -> int:
    """The sampler process: ``main([FD_IN, FD_OUT])`` (see :data:`_CHILD`)."""
    from gpulens.monitor import Monitor

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rx = Receiver(int(argv[0]))
    tx = Sender(int(argv[1]), blocking=True)
    try:
        config = rx.recv()
    except LinkClosed:
        return 0
    try:
        sinks: list[Sink] = [_build(spec) for spec in config["sinks"]]
        if config["rows_back"]:
            sinks.append(LinkSink(tx))
        monitor = Monitor(
            config["gpus"], config["interval"], sinks, config["backend"],
            buffer_rows=config["buffer_rows"], distributed=False, isolation="thread",
            **config["reads"],
        )
        monitor.start(config["step"])
    except ValueError as exc:
        tx.send(("error", "ValueError", str(exc)))
        return 2
    except Exception as exc:
        tx.send(("error", type(exc).__name__, str(exc)))
        return 1
    sampler = monitor._sampler
    assert sampler is not None and monitor.context is not None
    tx.send(("ready", monitor.context,
             [g.torch_index for g in sampler.gpus if g.torch_index is not None]))
    timeout = 10.0
    stopping = False
    while not stopping:
        # Poll, never block: a reader asleep on the pipe would make each of the training
        # thread's writes pay for waking it (see gpulens.link).
        time.sleep(POLL_S)
        for msg in rx.poll():
            kind = msg[0]
            if kind == "m":
                _, step, t, wall, scalars, alloc = msg
                sampler.marks.append(Mark(step, t, wall, scalars, alloc))
            elif kind == "latest":
                tx.send(("latest", msg[1], monitor.latest()))
            elif kind == "stop":
                timeout = float(msg[1]) if math.isfinite(msg[1]) else 10.0
                stopping = True
                break
        if rx.eof:
            break  # the training process is gone: write what we hold and end
    stats = monitor.stop(timeout)
    tx.send(("stopped", {k: v for k, v in stats.items() if not k.startswith("LinkSink")}))
    return 0

