"""The engine process's side of :mod:`gpulens.transport.process`: what runs in the process
that :data:`~gpulens.transport.spawn.CHILD` starts (``main([FD_IN, FD_OUT, FD_ROWS])``, and a
fourth argument ``spare`` for a spare: :mod:`gpulens.transport.spawn`).

It builds an :class:`~gpulens.engine.engine.Engine` from the spec it is sent, polls its pipe
for marks and requests every :data:`~gpulens.transport.process.POLL_S`, sends rows back on a
pipe of their own (never blocking on it: a backlog waits in memory), log records and figures
on the other, and exits once stopped or once the training process has gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

from gpulens.log import forward_records
from gpulens.model import JobShape, Mark, Outcome, Row
from gpulens.transport import messages as msgs
from gpulens.transport.pipe import LinkClosed, Receiver, Sender
from gpulens.transport.process import POLL_S, STATS_EVERY_S, STOP_GRACE_S
from gpulens.transport.spawn import SPARE_ARG


def main(argv: list[str]) -> int:
    """The engine process: ``main([FD_IN, FD_OUT, FD_ROWS])``, or with a fourth argument
    ``spare`` a spare's (see :data:`~gpulens.transport.spawn.CHILD`)."""
    from gpulens.engine.engine import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM too: a launcher that stops a job (torchrun, Slurm) signals each rank's process
    # group, this process included; it ends once the training process has gone (end of file
    # on its pipe), after writing the rows it holds, instead of losing them
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spare = argv[3:4] == [SPARE_ARG]
    if spare:
        _import_sources()
        # wait for the start, or end unused: the training process would have to live this
        # long without starting a monitor (a Trainer built, never trained)
        # (poll, not select: the training process's pipe numbers, which this keeps, may be
        # over select's 1023)
        waiting = select.poll()
        waiting.register(int(argv[0]), select.POLLIN)
        if not waiting.poll(float(argv[4]) * 1000.0):
            return 0
    rx = Receiver(int(argv[0]))
    tx = Sender(int(argv[1]), blocking=True)
    # rows back on a pipe the training process reads when it logs: never block on it (a
    # backlog waits in memory, written out as the pipe makes room)
    rows_tx = Sender(int(argv[2]), blocking=False)
    try:
        start = rx.recv()
    except LinkClosed:
        return 0
    if not isinstance(start, msgs.Start):
        return 2
    spec = start.spec
    # as the training process is now (a spare was spawned earlier, as it was then)
    os.environ.clear()
    os.environ.update(start.env)
    if start.cwd is not None:
        with contextlib.suppress(OSError):  # removed since: a relative path fails as it would
            os.chdir(start.cwd)
    forward_records(lambda record: tx.send(msgs.LogOut(record)), spec.log_level)

    def row_back(row: Row, final: bool) -> None:
        rows_tx.send(msgs.RowOut(row, final), force=True)

    def rows_out(timeout: float) -> None:
        """Before an answer that says the rows are all sent: the backlog written out (the
        training process reads the rows pipe while it waits for that answer)."""
        deadline = time.monotonic() + timeout
        while rows_tx.pending_bytes and not rows_tx.closed and time.monotonic() < deadline:
            rows_tx.flush()
            time.sleep(0.002)

    def late_job() -> JobShape | None:
        """The job's shape, which the client sends right after the spec (``job_follows``)."""
        got = rx.recv()
        if not isinstance(got, msgs.Job):
            raise RuntimeError(f"expected the job's shape after the spec, got {type(got)}")
        return got.shape

    engine = Engine(spec, on_row=row_back)
    try:
        context, torch_indices = engine.start(late_job if start.job_follows else None)
    except ValueError as exc:
        tx.send(msgs.Failed(True, "ValueError", str(exc)))
        return 2
    except Exception as exc:
        tx.send(msgs.Failed(False, type(exc).__name__, str(exc)))
        return 1
    tx.send(msgs.Ready(context, torch_indices))
    timeout, stall, collective = 120.0, 20.0, True
    outcome: Outcome = "finished"
    next_stats = time.monotonic() + STATS_EVERY_S
    stopping = False
    while not stopping:
        # Poll, never block: a reader asleep on the pipe would make each of the training
        # thread's writes pay for waking it (see gpulens.transport.pipe).
        time.sleep(POLL_S)
        for msg in rx.poll():
            if type(msg) is tuple:  # a mark, as it crosses (see gpulens.transport.messages)
                engine.mark(Mark(*msg))
            elif isinstance(msg, msgs.LatestAsk):
                tx.send(msgs.LatestReply(msg.seq, engine.latest()))
            elif isinstance(msg, msgs.ProcessesAsk):
                tx.send(msgs.ProcessesReply(msg.seq, engine.processes()))
            elif isinstance(msg, msgs.Finish):
                engine.finish(msg.row)
            elif isinstance(msg, msgs.Drain):
                engine.drain()  # the last raw rows are sent before the answer
                rows_out(STOP_GRACE_S)
                tx.send(msgs.Drained())
            elif isinstance(msg, msgs.Stop):
                timeout, stall, collective = msg.timeout, msg.stall, msg.collective
                outcome = msg.outcome
                stopping = True
                break
        if rx.eof:
            # the training process is gone without a stop (killed, or it crashed in C):
            # write what we hold and end
            collective, outcome = False, "killed"
            break
        if time.monotonic() >= next_stats:
            next_stats = time.monotonic() + STATS_EVERY_S
            tx.send(msgs.StatsOut(engine.stats(), engine.dropped_marks))
    dropped = engine.dropped_marks
    stats = engine.stop(timeout, stall, collective, outcome)
    rows_out(STOP_GRACE_S)
    tx.send(msgs.Stopped(stats, dropped))
    # Everything is written and closed: end now.  A normal exit would wait for what tracker
    # libraries leave behind (MLflow's threads: ~2 s after a healthy run), or for a sink given
    # up on, still stuck in a write; the training process's stop() waits for this exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _import_sources() -> None:
    """What the engine's start imports, imported by a spare while it waits (NVML's binding
    and psutil: 0.04 s and more where their bytecode is not cached)."""
    for name in ("pynvml", "psutil"):
        with contextlib.suppress(Exception):
            __import__(name)
