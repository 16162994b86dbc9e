"""The two-level gather of a distributed job (see :mod:`gpulens.distributed`): the start
exchange, and where each rank's per-row work (:class:`~gpulens.distributed.rows.RowGather`)
runs.

Roles, from the start exchange (:mod:`gpulens.distributed.start`):

* every rank but a node's leader writes each of its raw rows, as an entry, to its slot in its
  node's shared file (:mod:`~gpulens.distributed.nodering`): a list of floats packed and
  copied into shared memory, no network, no wait;
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
* **a job of one node** (up to :func:`~gpulens.schema.full_gpus` ranks, the common case):
  rank 0 leads it, and all of the above runs in the ranks' *engines*, not in the training
  processes (:meth:`JobGather.engine_plan`): each engine writes its own entries, rank 0's
  reduces the node and writes the job's row in one pass, and no summary crosses the store.
  Under DDP on two H200s the gather's Python in the training processes cost each rank
  0.5-0.6 ms a row of its step (``docs/design-notes.md``, "eighth session").  With
  ``isolation="thread"`` the engines, and so the gather, run in the training processes.
* **a job of several nodes** runs in the engines too where the job's store is a ``TCPStore``
  (the launchers' ``env://``): the leaders' and rank 0's engines connect to it themselves
  (:attr:`GatherPlan.store`); with another store the training processes do the per-row work
  (:meth:`JobGather.bind`).

Faults.  A row waits for the ranks of its node at most :data:`NODE_WAIT_S` after the
leader's own row for that step, and for the nodes at most :data:`JOB_WAIT_S` after rank 0's
own row; a rank whose slot's writer has exited is not waited for at all (its pid is
checked: a node's ranks share the host).  The writer is the rank's engine where the engines
gather: a rank whose training process exited is still waited for while its engine writes
the rows of the steps it logged (the engine ends soon after its training process, and says
how many rows it wrote).  A row without every rank is written all the same, marked:
``job/ranks``, ``job/nodes``, ``job/partial`` (and ``node/{n}/partial``).  The first such row
names what is missing in one WARNING on rank 0 (a node's leader logs it at INFO); a rank or node
missing from then on is not waited for again, and one that comes back is said at INFO (a later
absence is said again).  ``log()`` never waits on any of it, and ``stop()`` waits a bounded
time (:meth:`~gpulens.distributed.rows.RowGather.flush`); a leader whose connection to the
store is still opening then (a short monitor) waits for it as long as rank 0 waits for the
node, and says what it could not send.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpulens.distributed.levels import JOB_WAIT_S, NODE_WAIT_S
from gpulens.distributed.nodering import NodeRing, ring_dir
from gpulens.distributed.rows import (
    PASS_S,
    RING,
    GatherPlan,
    RowGather,
    attach_ring,
    create_ring,
    store_address,
)
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
from gpulens.log import logger
from gpulens.model import Row, RunContext
from gpulens.schema import full_gpus
from gpulens.sinks import SinkSpec

__all__ = ["JOB_WAIT_S", "NODE_WAIT_S", "PASS_S", "RING", "JobGather", "check_rank_gpus"]


def check_rank_gpus(gpus: Sequence[int] | None) -> None:
    """A ``ValueError`` (one line, on every rank alike, before the start exchange) for a rank
    that names more than one GPU: a rank's row carries one GPU, keyed by its global rank, so
    the others were dropped without a word and every rank's GPU went under its local number
    (``gpus=[0, 1]`` on two ranks gave rows with ``gpu/0`` alone)."""
    if gpus is not None and len(gpus) > 1:
        raise ValueError(
            f"gpus={list(gpus)}: in a distributed job each rank watches one GPU, the one it "
            "trains on (its row's GPU is keyed by the global rank); give each rank one device "
            "number, or gpus=None for its LOCAL_RANK's GPU")


class JobGather:
    """One rank's part in the gather (module doc).  Made in ``Monitor.start()`` on every
    rank, in the same order (its start exchange goes through the store)."""

    def __init__(self, submit: Callable[[Row], None], *, store: Any = None,
                 placement: Placement | None = None, timeout: float = START_TIMEOUT_S,
                 generation: int | None = None, gpus: Sequence[int] | None = None) -> None:
        """``store`` and ``placement``: the job's store and this rank's place (default:
        torch.distributed's default store, and :func:`placement_from_env`); ``generation``:
        which gather of the job this is (default: counted in this process); ``gpus``: the
        monitor's ``gpus`` (:func:`check_rank_gpus`, before any exchange)."""
        check_rank_gpus(gpus)
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
        self.crosses_store = not (self.m.nodes == 1 and not self.scaled)
        """The job level goes through the store (several nodes, or node rows of their own):
        rank 0 does not lead its node."""
        self.store_address = store_address(store) if self.crosses_store else None
        """The job's ``TCPStore`` (host, port), where the engines can reach it themselves.
        Every rank decides alone, and alike: the ranks of a job share one kind of store (one
        init method); the engines' keys are the raw store's, the training processes' the
        default store's (under torch's prefixes), so a job split between the two would lose
        its nodes' summaries (every row partial, the nodes said missing)."""
        self.in_engine = not self.crosses_store or self.store_address is not None
        """The engines do the per-row work (a job of one node; several, where the store is a
        ``TCPStore``: module doc)."""
        self.shape: JobShape | None = None
        self._shaped = False
        self._ring: NodeRing | None = None
        self._closed = False
        self._late = 0
        """Rows that came with no per-row work here to take them (counted in late_rows)."""
        self.work: RowGather | None = None
        """The per-row work, where it runs in this process (a job of several nodes whose
        store is no ``TCPStore``)."""
        if self.is_leader:
            path = ring_dir() / f"gpulens-{self.m.token}-n{self.node}"
            self._ring = create_ring(path, self.m)
            store.set(self.m.prefix + f"ring/{self.node}", str(path))

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

    def engine_plan(self) -> GatherPlan | None:
        """Where the engines do the per-row work (:attr:`in_engine`): what this rank's engine
        needs for it, before the engine starts (a rank waits, bounded, for its node's file);
        ``None`` where this process does it, or where this rank could not join its node's
        file (said: its rows are then not gathered). Rank 0 of a job whose job level crosses
        the store still merges the other nodes' rows without its node's file (an empty
        ``ring``)."""
        if not self.in_engine:
            return None
        if not self.is_leader and self._ring is None:
            self._attach()
        if self._ring is None:
            if self.is_writer and self.crosses_store:
                return GatherPlan(self.m, "", self.full, store=self.store_address)
            return None
        # written by the engine, not this process: the engine says its pid as it opens the
        # file, before it answers the start; until then this process stands for it (a slot
        # counted alive while nothing would ever write it made rank 0 wait NODE_WAIT_S; a
        # start that falls back to a thread claims the slot again in bind())
        self._ring.claim(self.m.slot, self.rank, os.getpid())
        return GatherPlan(self.m, str(self._ring.path), self.full, store=self.store_address)

    def bind(self, context: RunContext) -> None:
        """After this rank's engine started: learn its GPU, tell the others; where this
        process does the per-row work, join the node's file and start it."""
        gpu = context.gpus[0].index if context.gpus else self.rank
        job = getattr(context, "job", None)
        if isinstance(job, JobShape):
            self.shape = job
        if self.is_leader:
            if not self.is_writer:
                shape = self.shape or JobShape(self.world, self.m.nodes, self.m.launcher)
                publish_node(self._store, self.m, shape.with_gpus(self.rank, context.gpus))
        elif not self.is_writer:
            publish_rank(self._store, self.m, context.gpus)
        if self.in_engine:
            return
        if not self.is_leader:
            self._attach()
        ring = self._ring
        if ring is not None:
            ring.claim(self.m.slot, self.rank, os.getpid())
        plan = GatherPlan(self.m, str(ring.path) if ring is not None else "", self.full)
        store = self._store
        # the leader's and rank 0's connections of their own, opened by the threads that use
        # them, as in an engine (:meth:`GatherPlan.gather`)
        self.work = RowGather(plan, self._submit, gpu=gpu, shape=self.shape, ring=ring,
                              connect=lambda: _clone(store)).start()

    def _attach(self) -> None:
        key = self.m.prefix + f"ring/{self.node}"
        try:
            wait = max(0.001, self._deadline - time.monotonic())
            self._store.wait([key], timedelta(seconds=wait))
            path = Path(self._store.get(key).decode())
            ring = attach_ring(path, self.m)
        except Exception as exc:
            logger.warning("gpulens: rank %d could not join its node's gather (%r); its rows "
                           "are not gathered", self.rank, exc)
            return
        self._ring = ring

    # -- rows (where this process does the per-row work) ---------------------------------------
    def local_row(self, row: Row) -> None:
        """This rank's raw row, in order (from ``log()`` as it takes the rows back, or the
        link thread at the end).  Rows that come before :meth:`bind` or after a stop are
        counted in ``late_rows``."""
        work = self.work
        if work is not None:
            work.local_row(row)
        else:
            self._late += 1

    @property
    def late_rows(self) -> int:
        work = self.work
        return self._late + (work.late_rows if work is not None else 0)

    @property
    def stats(self) -> dict[str, float]:
        """The per-row work's figures (:attr:`RowGather.stats`; ``{}`` where the engine does
        it)."""
        work = self.work
        return work.stats if work is not None else {}

    # -- stop ----------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """At stop, after the engine's last rows came back (where this process does the
        per-row work: :meth:`RowGather.flush`), then :meth:`close`."""
        try:
            if self.work is not None:
                self.work.flush(timeout)
        except Exception as exc:
            logger.warning("gpulens: gathering the last rows failed: %r", exc)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the per-row work here, if any; release the node's file (its leader's process
        removes it).  Not a collective; idempotent."""
        if self._closed:
            return
        self._closed = True
        work = self.work
        if work is not None:
            work.close()
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

    @property
    def ring(self) -> NodeRing | None:
        """The node's file as this process opened it (``None`` once closed)."""
        return self._ring


def _clone(store: Any) -> Any:
    """A connection of its own to the store, where the store can make one (TCPStore)."""
    try:
        return store.clone()
    except Exception:
        return store
