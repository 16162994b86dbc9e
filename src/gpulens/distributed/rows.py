"""The gather's per-row work (:class:`RowGather`): a rank's rows into its node's shared file, a
node leader's node level, rank 0's job level (:mod:`~gpulens.distributed.levels`).

Where it runs:

* **a job of one node** (up to :func:`~gpulens.schema.full_gpus` ranks): in each rank's
  *engine* (:mod:`gpulens.engine`), made from the picklable :class:`GatherPlan` that the start
  exchange gave.  Each engine writes its rows into the node's file itself; rank 0's engine
  leads the node, reduces and merges each row and finishes it where it is finished anyway.
  Nothing of it runs in the training process: no row comes back to it, no thread of the
  gather shares its interpreter (under DDP on two H200s that Python cost each rank 0.5-0.6 ms
  a row of its step, ``docs/design-notes.md``, "eighth session").
* **a job of several nodes** (or of more than ``full`` ranks on one): in the engines too when
  the job's store is a ``TCPStore`` (torchrun, Slurm and Lightning's ``env://``): the leaders'
  and rank 0's engines each open a connection of their own to it (the plan's ``store``:
  host and port): a leader from a thread beside its gather loop (summaries made meanwhile
  wait, in order), rank 0 from its receiving thread, so neither the engine's start nor the
  reading of the node's file waits for the import of torch it takes (~0.7 s and ~210 MB on a
  CPU host, in those engines only). A node's summary crosses to rank 0's engine through the
  store. With any other store (a ``FileStore``, a ``HashStore``) the training process does
  it (:class:`~.gather.JobGather` makes it at ``bind``).

Either way one thread (``gpulens-gather``) on a leader and on rank 0 does the work, at most
one pass per :data:`PASS_S`; rank 0 of several nodes has a second (``gpulens-gather-rx``) that
waits for the nodes' summaries.  Its faults are :mod:`~.gather`'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpulens.distributed import aggregate as agg
from gpulens.distributed import levels
from gpulens.distributed.channel import MAX_QUEUED_PER_NODE, UpChannel
from gpulens.distributed.levels import POLL_S, JobLevel, NodeLevel
from gpulens.distributed.nodering import NodeRing
from gpulens.distributed.start import Membership
from gpulens.distributed.topology import JobShape
from gpulens.log import logger, warn_once
from gpulens.model import Row

__all__ = ["PASS_S", "RING", "GatherPlan", "RowGather"]

RING = 64
"""Entries each rank's slot holds (a leader that falls further behind loses entries)."""
PASS_S = 0.01
"""The gather thread works at most once per this many seconds: rows that come faster (a loop
logging every step) are taken in batches, so its wake-ups are bounded by 1/PASS_S a second
whatever the logging rate."""


@dataclass(frozen=True)
class GatherPlan:
    """What a rank's :class:`RowGather` needs from the start exchange (it pickles: it crosses
    to the engine process)."""

    m: Membership
    ring: str
    """The node's shared file."""
    full: int
    """:func:`~gpulens.schema.full_gpus` of the job (read once, in the training process)."""
    store: tuple[str, int] | None = None
    """Where the job level crosses the store (several nodes, or a node row of its own): the
    job's ``TCPStore``, host and port, for a connection of the engine's own; ``None`` in a
    job of one node, where rank 0 leads."""

    def open_ring(self) -> NodeRing:
        return attach_ring(Path(self.ring), self.m)

    def gather(self, submit: Callable[[Row], None], *, gpu: int,
               shape: JobShape | None = None) -> RowGather:
        """This rank's per-row work in its engine, started: the node's file opened and, where
        the job level crosses the store, the leader's and rank 0's connections to it, opened
        by their threads."""
        connect = None
        if self.store is not None and (self.m.is_leader or self.m.rank == 0):
            address = self.store

            def connect() -> Any:
                return connect_store(address)

        ring = self.open_ring() if self.ring else None
        if ring is not None:
            ring.writer(self.m.slot, os.getpid())  # this engine writes the rank's slot
        return RowGather(self, submit, gpu=gpu, ring=ring, shape=shape,
                         connect=connect).start()


REACH_S = 5.0
"""How long a connection to the job's store may take to open (a plain TCP connect first, so
that a store that cannot be reached is said within seconds, not after torch's own retries)."""


def connect_store(address: tuple[str, int], timeout: float = 60.0) -> Any:
    """A connection of its own to the job's ``TCPStore`` at ``address`` (imports torch);
    ``OSError`` within :data:`REACH_S` where nothing answers there."""
    socket.create_connection(address, timeout=REACH_S).close()
    from torch.distributed import TCPStore  # type: ignore[attr-defined,unused-ignore]

    return TCPStore(address[0], address[1], is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout))


def store_address(store: Any) -> tuple[str, int] | None:
    """Host and port of the ``TCPStore`` under ``store`` (torch's default store is a
    ``PrefixStore`` over the launcher's), or ``None`` for any other kind of store."""
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined,unused-ignore]

        raw = store
        for _ in range(8):
            under = getattr(raw, "underlying_store", None)
            if under is None:
                break
            raw = under
        if isinstance(raw, TCPStore) and raw.host and int(raw.port) > 0:
            return str(raw.host), int(raw.port)
    except Exception:  # another torch: the training process gathers
        return None
    return None


def attach_ring(path: Path, m: Membership) -> NodeRing:
    """Open the node's file that ``m``'s leader made (``ValueError`` if it is not that)."""
    return NodeRing.attach(path, len(m.members), RING, agg.RANK_WIDTH)


def create_ring(path: Path, m: Membership) -> NodeRing:
    """Make ``m``'s node's file (its leader, at the start exchange)."""
    return NodeRing.create(path, len(m.members), RING, agg.RANK_WIDTH)


class RowGather:
    """One rank's per-row part of the gather (module doc).  ``local_row`` takes this rank's
    raw rows in order; finished rows (a node's row on its leader in a job of more than
    ``full`` ranks, the job's on rank 0) go to ``submit``.

    Args:
        plan: from the start exchange.
        submit: where finished rows go (the engine's finishing).
        gpu: this rank's GPU number (its entries say it).
        shape: the job's shape as this rank knows it (the WARNINGs name nodes and GPUs).
        ring: the node's file, opened (:meth:`GatherPlan.open_ring`); ``None`` where this
            rank could not open it (said where that failed): its rows are not gathered.
        connect: makes a new connection to the job's store, where the job level crosses it
            (several nodes): a leader's, for pushing its summaries to rank 0, and rank 0's,
            for popping them, are each opened by the thread that uses it, beside the gather
            loop (in an engine, the first imports torch: seconds).
    """

    def __init__(self, plan: GatherPlan, submit: Callable[[Row], None], *, gpu: int,
                 ring: NodeRing | None, shape: JobShape | None = None,
                 connect: Callable[[], Any] | None = None) -> None:
        self.m = m = plan.m
        self.rank, self.world = m.rank, m.world
        self.is_writer = self.rank == 0
        self.is_leader = m.is_leader
        self.node = m.node
        self.full = plan.full
        self.scaled = self.world > self.full
        self.shape = shape
        self.gpu = gpu
        self._submit = submit
        self._ring = ring
        self._lock = threading.Lock()
        self._written = 0
        self._closed = False
        self._finishing = False
        self.misstepped: set[int] = set()
        """Ranks seen logging other steps than their leader (told once, by the node level)."""
        self.stopped: set[int] = set()
        """Ranks of this node whose monitor stopped (its slot done, every entry read): a row
        without them is told as that, not as a rank that exited or stalls."""
        self._levels: tuple[NodeLevel | None, JobLevel | None] = (None, None)
        """The gather thread's node and job levels (for the count of rows left at stop)."""
        self._finish_began: float | None = None
        """When :meth:`flush` began (the stop's waits count from there)."""
        self._finish_deadline: float | None = None
        """When :meth:`flush`'s time-out runs out."""
        self._wake = threading.Condition()
        self._signalled = False
        """A wake-up is pending (under ``_wake``): later rows do not notify again."""
        self._own: deque[Row] = deque()
        """The leader's own rows, for the node level."""
        self._own_job: deque[Row] = deque()
        """Rank 0's own rows, for the job level."""
        self.late_rows = 0
        self.stats: dict[str, float] = {"rows": 0, "partial": 0, "lost": 0, "busy_s": 0.0,
                                        "cpu_s": 0.0, "wakes": 0, "passes": 0,
                                        "unsent_dropped": 0}
        """For benchmarks: rows written (node rows on a leader, job rows on rank 0), partial
        ones, entries lost; the gather thread's wall and CPU seconds at work, the wake-ups
        sent to it and the passes it made (each takes every row waiting), a leader's summaries
        dropped before its connection to the store opened."""
        self._channel: UpChannel | None = None
        """A leader's push connection, once open."""
        self._rx_channel: UpChannel | None = None
        """Rank 0's popping connection, once open."""
        self._connect = connect
        self._unsent: deque[bytes] = deque()
        """A leader's summaries made before its connection to the store was open (at most
        :data:`~.channel.MAX_QUEUED_PER_NODE`; older ones are dropped, counted in
        ``stats["unsent_dropped"]`` and said)."""
        self._connector: threading.Thread | None = None
        self._rx: deque[bytes] = deque()
        """Summaries rank 0's receiving thread took, for the gather thread."""
        self._thread: threading.Thread | None = None
        self._rx_thread: threading.Thread | None = None

    def start(self) -> RowGather:
        """Start the thread (a leader, rank 0) and rank 0's receiving thread (several
        nodes)."""
        if self.is_leader or self.is_writer:
            self._thread = threading.Thread(target=self._work, name="gpulens-gather",
                                            daemon=True)
            self._thread.start()
        if self._connect is not None and self.is_writer:
            self._rx_thread = threading.Thread(target=self._receive, name="gpulens-gather-rx",
                                               daemon=True)
            self._rx_thread.start()
        if self._connect is not None and self.is_leader and not self.is_writer:
            # a leader's push connection, opened beside the gather loop (the import of torch
            # and the connect take seconds: the node's file is read meanwhile)
            self._connector = threading.Thread(target=self._open_push, daemon=True,
                                               name="gpulens-gather-connect")
            self._connector.start()
        return self

    def _open_push(self) -> None:
        channel = self._open_channel()
        if channel is not None:
            with self._lock:
                self._channel = channel
            self._signal()  # summaries made meanwhile go now

    def _open_channel(self, waits: bool = False) -> UpChannel | None:
        """A channel on a connection of its own (``connect``); ``waits``: its pops wait with
        no time-out. ``None``, said, where the store cannot be reached."""
        assert self._connect is not None
        try:
            store = self._connect()
            if waits:
                with contextlib.suppress(Exception):
                    store.set_timeout(timedelta(days=1))
        except Exception as exc:
            if not self._closed:
                warn_once("gather-store", "gpulens: rank %d cannot reach the job's store "
                          "(%r): %s", self.rank, exc,
                          "the nodes' figures are not merged" if self.is_writer else
                          "its node's figures do not reach rank 0")
            return None
        return UpChannel(store, self.m.prefix, self.m.nodes)

    # -- rows in ---------------------------------------------------------------------------
    def local_row(self, row: Row) -> None:
        """This rank's raw row, in order."""
        with self._lock:
            if self._closed:
                self.late_rows += 1
            else:
                if self.is_leader:
                    self._own.append(row)
                elif self._ring is not None:
                    entry = agg.pack_rank(row.step, row.time, row.values, self.rank,
                                          self.gpu, self.node)
                    self._ring.write(self.m.slot, self._written, entry)
                    self._written += 1
                if self.is_writer:
                    self._own_job.append(row)
        if self._closed:
            warn_once("gather-late", "gpulens: a row of rank %d came after its gather closed "
                      "at stop and is not written (counted in late_rows)", self.rank)
        elif self.is_leader or self.is_writer:
            self._signal()

    def _signal(self) -> None:
        """Wake the gather thread, once until it starts its next pass (rows that come while a
        wake-up is pending join that pass: no notify, no thread switch per row)."""
        if self._signalled:  # read without the lock: at worst one notify too many
            return
        with self._wake:
            self._signalled = True
            self.stats["wakes"] += 1
            self._wake.notify()

    def take_rx(self) -> list[bytes]:
        """The node summaries rank 0's receiving thread took since the last call."""
        with self._lock:
            got = list(self._rx)
            self._rx.clear()
        return got

    def take_own(self, job: bool) -> list[Row]:
        """The rows that came since the last call (the thread's side of :meth:`local_row`)."""
        with self._lock:
            queue = self._own_job if job else self._own
            rows = list(queue)
            queue.clear()
        return rows

    # -- the threads ---------------------------------------------------------------------------
    def _receive(self) -> None:
        """Rank 0: wait for node summaries on the store (a connection of its own)."""
        channel = self._rx_channel = self._open_channel(waits=True)
        if channel is None:
            return
        while not self._closed:
            try:
                got = [raw for raw in channel.pop_wait() if raw]
            except Exception as exc:
                if not self._closed:
                    logger.warning("gpulens: rank 0 can no longer read the nodes' figures from "
                                   "the job's store (%r); rows go on with its own node's", exc)
                return
            if got:
                with self._lock:
                    self._rx.extend(got)
                self._signal()

    def _work(self) -> None:
        node = NodeLevel(self) if self.is_leader else None
        job = JobLevel(self) if self.is_writer else None
        self._levels = (node, job)
        last = -PASS_S
        try:
            while True:
                with self._wake:
                    if self._closed:
                        return
                    if not self._signalled:
                        self._wake.wait(self._sleep(node, job))
                    # a batch: at most one pass per PASS_S (a stop cuts the wait short)
                    rest = last + PASS_S - time.monotonic()
                    if rest > 0 and not (self._finishing or self._closed):
                        self._wake.wait(rest)
                    self._signalled = False
                    finishing = self._finishing
                last = time.monotonic()
                self.stats["passes"] += 1
                t1, c1 = time.perf_counter(), time.thread_time()
                if node is not None:
                    for summary, node_out in node.poll():
                        self._hand_up(summary, node_out, job)
                    if self._unsent:  # made before the connection opened (it now has)
                        self._send_unsent()
                if job is not None:
                    job.poll()
                self.stats["busy_s"] += time.perf_counter() - t1
                self.stats["cpu_s"] += time.thread_time() - c1
                if finishing and (node is None or node.finished()) and (
                        job is None or job.finished()):
                    if node is not None and not self.is_writer:
                        self._push_done()
                    return
        except Exception as exc:
            if not self._closed:
                logger.warning("gpulens: rank %d's gather failed (%r); the rows it gathers are "
                               "no longer written", self.rank, exc)

    def _sleep(self, node: NodeLevel | None, job: JobLevel | None) -> float | None:
        """How long the thread may sleep: a leader with a row waiting for its ranks looks at
        the node's file every :data:`POLL_S`; rank 0 sleeps until a summary or its own row
        comes, or its oldest row's wait runs out."""
        if self._finishing or (node is not None and node.waiting()):
            return POLL_S
        due = job.due() if job is not None else None
        return None if due is None else max(0.0, due)

    def _hand_up(self, summary: agg.NodeSummary, node_out: dict[str, float],
                 job: JobLevel | None) -> None:
        if job is not None:  # rank 0 leads its node
            job.add(summary, node_out)
            return
        if self._channel is None and self._connect is None:
            return  # no way to rank 0
        # in order, behind any made before the connection opened (kept while it opens)
        self._unsent.append(summary.encode(agg.featured_slots(self.world, self.full)))
        while len(self._unsent) > MAX_QUEUED_PER_NODE:
            self._unsent.popleft()
            self.stats["unsent_dropped"] += 1
            warn_once("gather-unsent", "gpulens: node %d's figures wait for a connection to "
                      "the job's store (more than %d rows); older ones are dropped",
                      self.node, MAX_QUEUED_PER_NODE)
        self._send_unsent()

    def _send_unsent(self) -> None:
        with self._lock:
            channel = self._channel
        while channel is not None and self._unsent:
            self._push(channel, self._unsent.popleft())

    def _push_done(self) -> None:
        """A leader at stop: what waits, then the node's last summary (rank 0 stops waiting
        for the node).  A connection still opening (an engine that imports torch on a busy
        host: seconds) is waited for while rank 0 still waits for the node at its own stop,
        :data:`~.levels.JOB_WAIT_S` from this stop's start (at least :data:`REACH_S`; never
        past the stop's own time-out): a monitor shorter than the connect (a ``with`` block
        around an evaluation, say) still sends its rows.  What cannot be sent is said."""
        connector = self._connector
        if connector is not None and connector.is_alive():
            now = time.monotonic()
            began = self._finish_began if self._finish_began is not None else now
            wait = max(REACH_S, levels.JOB_WAIT_S - (now - began))
            if self._finish_deadline is not None:  # within the stop's own time-out
                wait = min(wait, self._finish_deadline - now - 0.2)  # 0.2 s to send
            connector.join(max(0.0, wait))
        opening = connector is not None and connector.is_alive()  # before the channel is read
        self._send_unsent()
        with self._lock:
            channel = self._channel
        if channel is not None:
            channel.push(self.node, agg.NodeSummary.done(self.node))
        elif self._unsent:
            self.stats["unsent_dropped"] += len(self._unsent)
            if not opening:
                self._unsent.clear()  # the store could not be reached: said when that failed
                return
            logger.warning("gpulens: node %d's last %d rows of figures were not sent: its "
                           "connection to the job's store did not open by the end of the stop "
                           "(rank 0 writes those rows without the node, marked partial)",
                           self.node, len(self._unsent))
            self._unsent.clear()

    def _push(self, channel: UpChannel, payload: bytes) -> None:
        if not channel.push(self.node, payload):
            warn_once("gather-full", "gpulens: node %d's figures wait in the store for rank 0 "
                      "(more than %d rows behind); later ones are dropped until it catches up",
                      self.node, MAX_QUEUED_PER_NODE)

    def submit(self, row: Row) -> None:
        """A finished node or job row."""
        self._submit(row)

    # -- stop ----------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """At stop, after this rank's last rows came: a rank marks its slot done; a leader and
        rank 0 write the rows they can still complete (waiting for the ranks and nodes while
        they may still come, at most :data:`~.levels.JOB_WAIT_S` past the last progress and
        ``timeout`` in all), then :meth:`close`."""
        try:
            with self._lock:
                if self._ring is not None and not self.is_leader:
                    self._ring.finish(self.m.slot, self._written)
            thread = self._thread
            if thread is None:
                return
            with self._wake:
                self._finish_began = time.monotonic()
                if timeout is not None:
                    self._finish_deadline = self._finish_began + timeout
                self._finishing = True
                self._wake.notify()
            thread.join(timeout)
            left = self._rows_waiting()
            if thread.is_alive() and left:
                logger.warning("gpulens: rank %d's last %d rows did not meet the others' within "
                               "%.0f s; they are not written", self.rank, left, timeout or 0.0)
            elif thread.is_alive():  # every row out; a rank alive that has not stopped yet
                logger.debug("gpulens: rank %d stopped waiting for the other ranks' ends after "
                             "%.1f s; no row was left", self.rank, timeout or 0.0)
        finally:
            self.close()

    def _rows_waiting(self) -> int:
        """Rows the gather thread still holds for the other ranks or nodes (read from another
        thread: a count, at worst one row off)."""
        node, job = self._levels
        return (len(node.order) if node is not None else 0) + (
            len(job.order) if job is not None else 0)

    def close(self) -> None:
        """Stop the threads; a rank marks its slot done.  Not a collective; idempotent.  (The
        node's file is removed by the process that made it: :class:`~.gather.JobGather`.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ring, self._ring = self._ring, None
        with self._wake:
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        if self._rx_thread is not None and self._rx_thread.is_alive():
            channel = self._channel
            if channel is None and self._connect is not None:  # rank 0 holds no push
                channel = self._open_channel()  # connection: its pop is woken from here
            if channel is not None:
                with contextlib.suppress(Exception):
                    channel.wake()  # its waiting pop returns
                self._rx_thread.join(2.0)
        if ring is not None:
            if not self.is_leader:
                ring.finish(self.m.slot, self._written)
            ring.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ring(self) -> NodeRing | None:
        return self._ring

    @property
    def channel(self) -> UpChannel | None:
        return self._channel

