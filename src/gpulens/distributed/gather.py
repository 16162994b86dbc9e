"""The two-level gather of a distributed job (see :mod:`gpulens.distributed`).

Roles, from the start exchange (:mod:`gpulens.distributed.start`):

* every rank but a node's leader writes each of its raw rows, as an entry, to its slot in its
  node's shared file (:mod:`~gpulens.distributed.nodering`), where the rows back from the
  engine are handed on: in ``log()``, on the training thread (a list of floats packed and
  copied into shared memory: no network, no wait, no thread woken);
* each node's *leader* (:attr:`~gpulens.distributed.start.Membership.leader`) runs a thread
  (``gpulens-gather``): it reads its node's entries, matches them by step, reduces each row
  (:func:`aggregate.reduce_node`), pushes the node summary to rank 0
  (:mod:`~gpulens.distributed.channel`) and, in a job of more than
  :data:`~gpulens.schema.FULL_GPUS` ranks, hands its node row to its engine (the node's JSONL
  and Prometheus);
* rank 0 runs a thread too: it pops the summaries and merges them with its own row
  (:func:`aggregate.merge_job`) into the job's row for its engine and every sink (the
  trackers' view: :mod:`gpulens.sinks.layout`).  In a job of several nodes rank 0 leads no
  node of two or more ranks, so its work per row is O(nodes) whatever the node size.
* a job of one node of two ranks: rank 0 leads it, and its thread reduces the node and
  writes the job's row in one pass.  No summary crosses the store and the other rank runs no
  gather thread (under DDP on two H200s the other arrangement cost each rank 0.5-0.6 ms of
  Python a row in its training process, ``docs/design-notes.md``, "eighth session").  Not
  beyond two: rank 0 would then carry more than any rank did before
  (:data:`~gpulens.distributed.start.RANK0_LEADS_UP_TO`).

Faults.  A row waits for the ranks of its node at most :data:`NODE_WAIT_S` after the
leader's own row for that step, and for the nodes at most :data:`JOB_WAIT_S` after rank 0's
own row; a rank whose process has exited is not waited for at all (its pid is checked: a
node's ranks share the host).  A row without every rank is written all the same, marked:
``job/ranks``, ``job/nodes``, ``job/partial`` (and ``node/{n}/partial``).  The first such row
names what is missing in one WARNING on rank 0 (a node's leader logs it at INFO); a rank or node
missing from then on is not waited for again, and one that comes back is said at INFO (a later
absence is said again).  ``log()`` never waits on any of it, and ``stop()`` waits a bounded
time (:meth:`JobGather.flush`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpulens.distributed import aggregate as agg
from gpulens.distributed.channel import MAX_QUEUED_PER_NODE, UpChannel
from gpulens.distributed.levels import JOB_WAIT_S, NODE_WAIT_S, POLL_S, JobLevel, NodeLevel
from gpulens.distributed.nodering import NodeRing, ring_dir
from gpulens.distributed.start import (
    START_TIMEOUT_S,
    Membership,
    default_store,
    job_shape,
    join,
    next_generation,
    node_shape,
    publish_node,
    publish_rank,
)
from gpulens.distributed.topology import JobShape, Placement, placement_from_env
from gpulens.log import logger, warn_once
from gpulens.model import Row, RunContext
from gpulens.schema import full_gpus
from gpulens.sinks import SinkSpec

__all__ = ["JOB_WAIT_S", "NODE_WAIT_S", "RING", "JobGather"]

RING = 64
"""Entries each rank's slot holds (a leader that falls further behind loses entries)."""
PASS_S = 0.01
"""The gather thread works at most once per this many seconds: rows that come faster (a loop
logging every step) are taken in batches, so its wake-ups, and the moments it takes the GIL
from the training thread, are bounded by 1/PASS_S a second whatever the logging rate."""


class JobGather:
    """One rank's part in the gather (module doc).  Made in ``Monitor.start()`` on every
    rank, in the same order (its start exchange goes through the store)."""

    def __init__(self, submit: Callable[[Row], None], *, store: Any = None,
                 placement: Placement | None = None, timeout: float = START_TIMEOUT_S,
                 generation: int | None = None) -> None:
        """``store`` and ``placement``: the job's store and this rank's place (default:
        torch.distributed's default store, and :func:`placement_from_env`); ``generation``:
        which gather of the job this is (default: counted in this process)."""
        if placement is None or store is None:
            import torch.distributed as dist

            placement = placement or placement_from_env(dist.get_rank(), dist.get_world_size())
            store = store if store is not None else default_store(dist)
        self._submit = submit
        self._store = store
        self._deadline = time.monotonic() + timeout
        self.m: Membership = join(store, placement,
                                  generation if generation is not None else next_generation(),
                                  timeout)
        self.rank, self.world = placement.rank, placement.world
        self.is_writer = self.rank == 0
        self.is_leader = self.m.is_leader
        self.node = self.m.node
        self.full = full_gpus()
        self.scaled = self.world > self.full
        """Above :func:`~gpulens.schema.full_gpus` ranks: node rows go to each node's sinks,
        rank 0's row holds aggregates and the worst few GPUs, not every GPU."""
        self.shape: JobShape | None = None
        self._shaped = False
        self._gpu = self.rank
        self._ring: NodeRing | None = None
        self._lock = threading.Lock()
        self._written = 0
        self._closed = False
        self._finishing = False
        self._wake = threading.Condition()
        self._signalled = False
        """A wake-up is pending (under ``_wake``): later rows do not notify again."""
        self._own: deque[Row] = deque()
        """The leader's own rows, for the node level."""
        self._own_job: deque[Row] = deque()
        """Rank 0's own rows, for the job level."""
        self.late_rows = 0
        self.stats: dict[str, float] = {"rows": 0, "partial": 0, "lost": 0, "busy_s": 0.0,
                                        "cpu_s": 0.0, "wakes": 0, "passes": 0}
        """For benchmarks: rows written (node rows on a leader, job rows on rank 0), partial
        ones, entries lost; the gather thread's wall and CPU seconds at work, the wake-ups
        sent to it and the passes it made (each takes every row waiting)."""
        self._channel: UpChannel | None = None
        self._rx_channel: UpChannel | None = None
        self._rx: deque[bytes] = deque()
        """Summaries rank 0's receiving thread took, for the gather thread."""
        self._thread: threading.Thread | None = None
        self._rx_thread: threading.Thread | None = None
        if self.is_leader:
            path = ring_dir() / f"gpulens-{self.m.token}-n{self.node}"
            self._ring = NodeRing.create(path, len(self.m.members), RING, agg.RANK_WIDTH)
            store.set(self.m.prefix + f"ring/{self.node}", str(path))
        # a leader pushes its summaries; rank 0 pops them (and wakes its popping thread
        # through a channel of its own), unless it leads the job's only node itself
        hears = self.is_writer and not (self.is_leader and self.m.nodes == 1)
        if (self.is_leader and not self.is_writer) or hears:
            self._channel = UpChannel(_clone(store), self.m.prefix, self.m.nodes)
        if hears:
            rx_store = _clone(store)
            with contextlib.suppress(Exception):  # its pops wait: no time-out while it runs
                rx_store.set_timeout(timedelta(days=1))
            self._rx_channel = UpChannel(rx_store, self.m.prefix, self.m.nodes)

    # -- start -------------------------------------------------------------------------------
    @property
    def placement(self) -> tuple[int, int, int]:
        """(global rank, local rank, world size), as the engine's spec has it."""
        return (self.rank, self.m.local_rank, self.world)

    def sinks_for(self, sinks: Sequence[Any]) -> list[Any]:
        """The sinks this rank writes: rank 0 all of them; in a job of more than
        :func:`~gpulens.schema.full_gpus` ranks, each node's leader each sink's node copy
        (a sink object's ``for_node(node)``, a spec's class's ``node_options``: JSONL,
        Prometheus); the others none."""
        if self.is_writer:
            return list(sinks)
        if not (self.is_leader and self.scaled):
            return []
        out: list[Any] = []
        for sink in sinks:
            if isinstance(sink, SinkSpec):  # chosen by name: its class says the node's options
                module, _, cls = sink.target.partition(":")
                node_options = getattr(getattr(importlib.import_module(module), cls),
                                       "node_options", None)
                if node_options is not None:
                    out.append(replace(sink, name=f"{sink.name} (node {self.node})",
                                       options=node_options(dict(sink.options), self.node)))
                continue
            for_node = getattr(sink, "for_node", None)
            copy = for_node(self.node) if for_node is not None else None
            if copy is not None:
                out.append(copy)
        return out

    def shape_before_engine(self) -> JobShape | None:
        """What this rank's engine context should hold about the job (its sinks open with
        it): rank 0's view of the whole job, a leader's of its node (each waits, bounded, for
        the others' GPUs); ``None`` for the other ranks."""
        if self._shaped:
            return self.shape
        self._shaped = True
        own = node_shape(self._store, self.m, self._deadline) if self.is_leader else None
        self.shape = (job_shape(self._store, self.m, own, self._deadline) if self.is_writer
                      else own)
        return self.shape

    def bind(self, context: RunContext) -> None:
        """After this rank's engine started: learn its GPU, tell the others, join the node's
        file, start the thread (leaders and rank 0)."""
        self._gpu = context.gpus[0].index if context.gpus else self.rank
        job = getattr(context, "job", None)
        if isinstance(job, JobShape):
            self.shape = job
        if self.is_leader:
            assert self._ring is not None
            self._ring.claim(self.m.slot, self.rank, os.getpid())
            if not self.is_writer:
                shape = self.shape or JobShape(self.world, self.m.nodes, self.m.launcher)
                publish_node(self._store, self.m, shape.with_gpus(self.rank, context.gpus))
        else:
            if not self.is_writer:
                publish_rank(self._store, self.m, context.gpus)
            self._attach()
        if self.is_leader or self.is_writer:
            self._thread = threading.Thread(target=self._work, name="gpulens-gather",
                                            daemon=True)
            self._thread.start()
        if self._rx_channel is not None:
            self._rx_thread = threading.Thread(target=self._receive, name="gpulens-gather-rx",
                                               daemon=True)
            self._rx_thread.start()

    def _attach(self) -> None:
        key = self.m.prefix + f"ring/{self.node}"
        try:
            wait = max(0.001, self._deadline - time.monotonic())
            self._store.wait([key], timedelta(seconds=wait))
            path = Path(self._store.get(key).decode())
            ring = NodeRing.attach(path, len(self.m.members), RING, agg.RANK_WIDTH)
        except Exception as exc:
            logger.warning("gpulens: rank %d could not join its node's gather (%r); its rows "
                           "are not gathered", self.rank, exc)
            return
        ring.claim(self.m.slot, self.rank, os.getpid())
        with self._lock:
            self._ring = ring

    # -- rows in ---------------------------------------------------------------------------
    def local_row(self, row: Row) -> None:
        """This rank's raw row, in order (from ``log()`` as it takes the rows back, or the
        link thread at the end)."""
        with self._lock:
            if self._closed:
                self.late_rows += 1
            else:
                if self.is_leader:
                    self._own.append(row)
                elif self._ring is not None:
                    entry = agg.pack_rank(row.step, row.time, row.values, self.rank,
                                          self._gpu, self.node)
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
        channel = self._rx_channel
        assert channel is not None
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
                if job is not None:
                    job.poll()
                self.stats["busy_s"] += time.perf_counter() - t1
                self.stats["cpu_s"] += time.thread_time() - c1
                if finishing and (node is None or node.finished()) and (
                        job is None or job.finished()):
                    if node is not None and not self.is_writer and self._channel is not None:
                        self._channel.push(self.node, agg.NodeSummary.done(self.node))
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
        if job is not None:  # rank 0 leads its node (a node of one rank)
            job.add(summary, node_out)
            return
        channel = self._channel
        if channel is not None and not channel.push(
                self.node, summary.encode(agg.featured_slots(self.world, self.full))):
            warn_once("gather-full", "gpulens: node %d's figures wait in the store for rank 0 "
                      "(more than %d rows behind); later ones are dropped until it catches up",
                      self.node, MAX_QUEUED_PER_NODE)

    def submit(self, row: Row) -> None:
        """A finished node or job row, for this rank's engine."""
        self._submit(row)

    # -- stop ----------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """At stop, after the engine's last rows came back: a rank marks its slot done; a
        leader and rank 0 write the rows they can still complete (waiting for the ranks and
        nodes while they may still come, at most :data:`JOB_WAIT_S` past the last progress
        and ``timeout`` in all), then :meth:`close`."""
        try:
            with self._lock:
                if self._ring is not None and not self.is_leader:
                    self._ring.finish(self.m.slot, self._written)
            thread = self._thread
            if thread is None:
                return
            with self._wake:
                self._finishing = True
                self._wake.notify()
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("gpulens: rank %d's last rows did not meet the others' within "
                               "%.0f s; they are not written", self.rank, timeout or 0.0)
        finally:
            self.close()

    def close(self) -> None:
        """Release the node file (a leader removes it).  Not a collective; idempotent."""
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
        if self._rx_thread is not None and self._channel is not None:
            with contextlib.suppress(Exception):
                self._channel.wake()  # its waiting pop returns
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


def _clone(store: Any) -> Any:
    """A connection of its own to the store, where the store can make one (TCPStore)."""
    try:
        return store.clone()
    except Exception:
        return store
