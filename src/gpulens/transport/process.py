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
import site
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpulens._warn import logger, warn_once
from gpulens.engine.sampler import Mark, _to_float
from gpulens.engine.steplogger import SinkStats
from gpulens.sinks.base import Row, RunContext, Sink
from gpulens.transport.pipe import LinkClosed, Receiver, Sender

READY_TIMEOUT_S = 120.0
"""How long ``start()`` waits for the sampler process to open NVML and its sinks (importing
MLflow can take seconds on a loaded machine)."""
_CHILD = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
          "from gpulens.transport.process import main; sys.exit(main(sys.argv[1:]))")
"""The sampler process's bootstrap: it ignores SIGINT before anything else (a Ctrl-C at the
terminal reaches the whole process group; the training process decides when to stop)."""
POLL_S = 0.02
"""How often the sampler process looks for step marks (they wait at least 0.2 s for the data
that closes their window anyway)."""
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
RELAY_MAX = 10_000
"""Marks with tensors that may wait for conversion before new ones are dropped (counted)."""


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
    """The training process's end: spawns the sampler process and talks to it.

    Only the process that started it talks to it: in a child forked from that process
    (``os.fork``, a fork-started DataLoader worker), the copies of the pipe ends are closed
    and every call does nothing.
    """

    def __init__(self, config: dict[str, Any], on_row: Callable[[Row], None]) -> None:
        self._config = config
        self._on_row = on_row
        self._pid = os.getpid()
        self._proc: subprocess.Popen[bytes] | None = None
        self._tx: Sender | None = None
        self._rx: Receiver | None = None
        self._reader: threading.Thread | None = None
        self._startup: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._replies: dict[int, dict[str, float]] = {}
        self._awaited: set[int] = set()
        self._reply_ready = threading.Condition()
        self._latest_seq = 0
        self._stopped = threading.Event()
        self._got_stopped = False
        self._child_stats: dict[str, SinkStats] = {}
        self._stopping = False
        self._killing = False
        self._relay: queue.SimpleQueue[Mark | None] | None = None
        self._relay_thread: threading.Thread | None = None
        self._relay_dropped = 0
        self.context: RunContext | None = None
        self.torch_indices: list[int] = []

    # -- start -------------------------------------------------------------------------------
    def start(self) -> RunContext:
        """Spawn, send the config, wait until the process is sampling.

        ``ValueError`` for a user error found there (no such GPU, a sink that cannot open);
        :class:`SpawnFailed` when the process could not be started at all.  Whatever ends the
        wait (KeyboardInterrupt too), the process is ended and the pipes closed before it
        propagates.
        """
        if not sys.executable:
            raise SpawnFailed("no Python executable to start (sys.executable is empty)")
        self._pid = os.getpid()
        child_ends: list[int] = []
        try:
            to_child_r, to_child_w = os.pipe()
            child_ends.append(to_child_r)
            self._tx = Sender(to_child_w, blocking=False)
            from_child_r, from_child_w = os.pipe()
            child_ends.append(from_child_w)
            self._rx = Receiver(from_child_r)
            for fd in (to_child_w, from_child_w):
                with contextlib.suppress(OSError):
                    import fcntl

                    fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD, str(to_child_r), str(from_child_w)],
                    pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
                    env=_child_env(), close_fds=True,
                )
            except OSError as exc:
                raise SpawnFailed(f"could not start the sampler process: {exc}") from exc
            finally:
                for fd in child_ends:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                child_ends.clear()
            _LIVE.add(self)
            self._reader = threading.Thread(target=self._read_loop, name="gpulens-link",
                                            daemon=True)
            self._reader.start()
            self._tx.send(self._config, force=True)
            try:
                got = self._startup.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise SpawnFailed(f"the sampler process did not start within "
                                  f"{READY_TIMEOUT_S:.0f} s") from None
            if got[0] == "ready":
                self.context, self.torch_indices = got[1], list(got[2])
                return self.context
            if got[0] == "error" and got[1] == "ValueError":
                raise ValueError(got[2])
            if got[0] == "error":
                raise SpawnFailed(f"the sampler process failed: {got[1]}: {got[2]}")
            code = self._proc.poll()
            raise SpawnFailed(f"the sampler process ended before it started (exit code "
                              f"{code})")
        except BaseException:
            for fd in child_ends:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._kill()
            _LIVE.discard(self)
            raise

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
                        if msg[1] in self._awaited:  # else its asker gave up: drop it
                            self._replies[msg[1]] = msg[2]
                            self._reply_ready.notify_all()
                elif kind == "stopped":
                    self._child_stats = msg[1]
                    self._got_stopped = True
                    self._set_stopped()
                elif kind in ("ready", "error") and not started:
                    started = kind == "ready"
                    self._startup.put(msg)
        except LinkClosed:
            pass
        except Exception as exc:
            warn_once("link-read", "gpulens: reading from the sampler process failed: %r", exc)
        finally:
            rx.close()  # this thread's to close: nothing reads it any more
            if not started:
                self._startup.put(("dead",))
            elif not self._got_stopped and not self._killing:
                # it ended by itself (stop() or not): say so
                code = self._proc.poll() if self._proc is not None else None
                logger.warning("gpulens: the sampler process ended (exit code %s); GPU rows "
                               "stop, training goes on", code)
            self._set_stopped()

    def _set_stopped(self) -> None:
        with self._reply_ready:
            self._stopped.set()
            self._reply_ready.notify_all()  # latest() need not wait out its timeout

    # -- fork ----------------------------------------------------------------------------------
    @property
    def forked(self) -> bool:
        """True in a process forked from the one that started this (which alone talks to
        the sampler process)."""
        return os.getpid() != self._pid

    def forget(self) -> None:
        """In a forked child: close this process's copies of the pipe ends and do nothing
        more (never send: the sampler process is the parent's)."""
        tx, rx = self._tx, self._rx
        self._tx = self._rx = None
        self._proc = None
        self._relay = None
        self.torch_indices = []  # log() reads no allocator for a sampler it does not feed
        if tx is not None:
            tx.abandon()
        if rx is not None:
            rx.abandon()

    # -- training thread ---------------------------------------------------------------------
    def mark(self, step: int, t: float, wall: float, scalars: dict[str, Any],
             alloc: dict[int, tuple[float, float]] | None) -> None:
        """Send a step mark (training thread; never blocks).  Scalars that are not plain
        numbers (tensors) are converted in a relay thread, which then sends every later mark
        too, in order."""
        tx = self._tx
        if tx is None:  # not started, stopped, or a forked child (see forget)
            return
        relay = self._relay
        if relay is None and _plain(scalars):
            if not tx.send(("m", step, t, wall, scalars, alloc)):
                self._warn_unsent(tx)
            return
        if relay is None:
            relay = self._start_relay()
            if relay is None:
                return
        if relay.qsize() >= RELAY_MAX:
            self._relay_dropped += 1
            warn_once("relay-full", "gpulens: logged tensors are not converted fast enough; "
                      "step marks are dropped (counted)")
            return
        relay.put(Mark(step, t, wall, scalars, alloc))

    def _start_relay(self) -> queue.SimpleQueue[Mark | None] | None:
        relay: queue.SimpleQueue[Mark | None] = queue.SimpleQueue()
        thread = threading.Thread(target=self._relay_loop, args=(relay,),
                                  name="gpulens-relay", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            warn_once("relay-start", "gpulens: could not start the relay thread (%s); marks "
                      "with tensors are left out", exc)
            return None
        self._relay, self._relay_thread = relay, thread
        return relay

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

    def _relay_loop(self, relay: queue.SimpleQueue[Mark | None]) -> None:
        while True:
            mark = relay.get()
            if mark is None:
                return
            try:
                scalars: dict[str, float] = {}
                for name, value in mark.scalars.items():
                    number = _to_float(value)  # a value it cannot read is left out
                    if number is not None:
                        scalars[name] = number
                mark.scalars = scalars
                self._send_mark(mark)
            except Exception as exc:  # this thread must outlive any one mark
                warn_once("relay-mark", "gpulens: could not send a step mark: %r", exc)

    @property
    def dropped_marks(self) -> int:
        """Step marks dropped (the pipe's queue or the relay's full), counted."""
        tx = self._tx
        return self._relay_dropped + (tx.dropped if tx is not None else 0)

    # -- live view -----------------------------------------------------------------------------
    def latest(self, timeout: float = 2.0) -> dict[str, float]:
        """The sampler process's newest sample of each metric (``{}`` if it does not answer,
        at once if it is gone or stopping)."""
        if self.forked:
            self.forget()
            return {}
        tx = self._tx
        if tx is None or tx.closed or self._stopped.is_set() or self._stopping:
            return {}
        with self._reply_ready:
            self._latest_seq += 1
            seq = self._latest_seq
            self._awaited.add(seq)
        try:
            if not tx.send(("latest", seq), force=True):
                return {}
            deadline = time.monotonic() + timeout
            with self._reply_ready:
                while seq not in self._replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopped.is_set() or self._stopping:
                        return {}
                    self._reply_ready.wait(left)
                return self._replies.pop(seq)
        finally:
            with self._reply_ready:
                self._awaited.discard(seq)
                self._replies.pop(seq, None)

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, timeout: float) -> dict[str, SinkStats]:
        """Send what is queued and ``stop``; wait for the last rows and the sinks' figures."""
        if self.forked:
            self.forget()
            return {}
        if self._stopping:
            return self._child_stats
        self._stopping = True
        with self._reply_ready:
            self._reply_ready.notify_all()  # a latest() waiting gives up now
        deadline = time.monotonic() + timeout + 5.0
        if self._relay is not None and self._relay_thread is not None:
            self._relay.put(None)
            self._relay_thread.join(max(0.0, deadline - time.monotonic()))
        tx = self._tx
        if tx is not None and not tx.closed:
            tx.send(("stop", timeout), force=True)
            while tx.pending_bytes and not tx.closed and time.monotonic() < deadline:
                time.sleep(0.002)
                tx.flush()
        if not self._stopped.wait(max(0.0, deadline - time.monotonic())):
            warn_once("child-stuck", "gpulens: the sampler process did not stop in %.0f s",
                      timeout + 5.0)
        if self._reader is not None:
            self._reader.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._kill(grace=max(0.5, deadline - time.monotonic()))
        _LIVE.discard(self)
        if not self._got_stopped and self._config.get("sinks"):
            logger.warning("gpulens: the sampler process ended without reporting its sinks' "
                           "figures; sink_stats lacks %s (rows it held may be unwritten)",
                           ", ".join(_sink_name(spec) for spec in self._config["sinks"]))
        dropped = self.dropped_marks
        if dropped:
            logger.warning("gpulens: %d step mark(s) were dropped (the sampler process did "
                           "not keep up); their steps have no rows of their own", dropped)
        return self._child_stats

    def _kill(self, grace: float = 0.0) -> None:
        self._killing = True
        tx = self._tx
        if tx is not None:
            tx.close()
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            # the child is gone: end of file is on its way to the reader, which closes rx
            reader.join(1.0)
        if self._rx is not None and (reader is None or not reader.is_alive()):
            self._rx.close()  # once: the reader may have closed it already


def _sink_name(spec: tuple[str, dict[str, Any]]) -> str:
    return spec[0].rpartition(":")[2] or spec[0]


_LIVE: weakref.WeakSet[SamplerProcess] = weakref.WeakSet()
"""Sampler processes this process talks to: a forked child forgets them (see forget)."""


def _forget_all_after_fork() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            proc.forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)


def _is_site_dir(path: str) -> bool:
    """Whether ``path`` is a site-packages directory (an installed gpulens lives there)."""
    dirs: list[str] = []
    with contextlib.suppress(Exception):
        dirs.extend(site.getsitepackages())
    with contextlib.suppress(Exception):
        dirs.append(site.getusersitepackages())
    real = os.path.realpath(path)
    if any(os.path.realpath(d) == real for d in dirs if d):
        return True
    return Path(path).name in ("site-packages", "dist-packages")


def _child_env() -> dict[str, str]:
    """The sampler process's environment: this one's, and for a gpulens that is not installed
    (a source checkout, a ``sys.path`` entry) the folder it was imported from first on
    ``PYTHONPATH``.  An installed gpulens is found as the parent found it; its site-packages
    is never put ahead of the standard library."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    if not _is_site_dir(root):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


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
        # thread's writes pay for waking it (see gpulens.transport.pipe).
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

