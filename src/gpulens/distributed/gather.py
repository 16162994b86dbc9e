"""The two-level gather of a distributed job (see :mod:`gpulens.distributed`).

Roles, from the start exchange (:mod:`gpulens.distributed.start`):

* every rank writes each of its raw rows, as an entry, to its slot in its node's shared file
  (:mod:`~gpulens.distributed.nodering`), from the thread that hands rows back from the
  engine: no thread of its own, no network, nothing on the training thread;
* each node's *leader* (its lowest rank) runs one thread (``gpulens-gather``): it reads its
  node's entries, matches them by step, reduces each row (:func:`aggregate.reduce_node`), hands
  its node row to its engine (its node's JSONL and Prometheus) and pushes the node summary to
  rank 0 (:mod:`~gpulens.distributed.channel`);
* rank 0, the leader of its node, merges the summaries (:func:`aggregate.merge_job`) into the
  job's row for its engine and every sink (the trackers' view, :mod:`gpulens.sinks.layout`).

Faults.  A row waits for the ranks of its node at most :data:`NODE_WAIT_S` after the
leader's own row for that step, and for the nodes at most :data:`JOB_WAIT_S` after rank 0's
node row; a rank whose process has exited is not waited for at all (its pid is checked: the
node's ranks share the host).  A row without every rank is written all the same, marked:
``job/ranks``, ``job/nodes``, ``job/partial`` (and ``node/{n}/partial``).  The first such row
names what is missing in one WARNING on rank 0 (a node's leader logs it at INFO); a rank or node
missing from then on is not waited for again, and one that comes back is said at INFO.
``log()`` never waits on any of it, and stop waits a bounded time (:meth:`JobGather.flush`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpulens._warn import logger, warn_once
from gpulens.distributed import aggregate as agg
from gpulens.distributed.channel import UpChannel
from gpulens.distributed.nodering import LOST, NodeRing, ring_dir
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
from gpulens.engine.spec import WORK_KEYS
from gpulens.sinks.base import Row, RunContext, Sink

NODE_WAIT_S = 10.0
"""How long a node's leader waits for a rank's row of a step once its own is in."""
JOB_WAIT_S = NODE_WAIT_S + 5.0
"""How long rank 0 waits for a node's summary of a step once its own node's is in."""
POLL_S = 0.05
"""How often a leader looks again while a row waits for some rank."""
RING = 64
"""Entries each rank's slot holds (a leader that falls further behind loses entries)."""
MAX_PENDING = 512
"""Rows a leader holds unfinished before it writes the oldest as it is."""

Key = tuple[int, int]
"""A row's key: (step, how many rows of that step came before it on this rank)."""


@dataclass
class _Pending:
    own: Row | None = None
    entries: dict[int, list[float]] = field(default_factory=dict)
    since: float = math.inf
    """When the leader's own row (rank 0: its node's row) came: the wait starts there."""
    summaries: dict[int, agg.NodeSummary] = field(default_factory=dict)
    node_out: dict[str, float] = field(default_factory=dict)


class JobGather:
    """One rank's part in the gather (module doc).  Made in ``Monitor.start()`` on every
    rank, in the same order (its start exchange is a collective through the store)."""

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
        place = placement
        rank, world = place.rank, place.world
        self._submit = submit
        self._store = store
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self.m: Membership = join(self._store, place,
                                   generation if generation is not None else next_generation(),
                                   timeout)
        self.rank, self.world = rank, world
        self.is_writer = rank == 0
        self.is_leader = self.m.is_leader
        self.node = self.m.node
        self.shape: JobShape | None = None
        self._shaped = False
        self._gpu = rank
        self._ring: NodeRing | None = None
        self._lock = threading.Lock()
        self._written = 0
        self._keys: dict[int, int] = {}
        self._last_step: int | None = None
        self._dup = 0
        self._closed = False
        self._finishing = False
        self._wake = threading.Condition()
        self._own: deque[Row] = deque()
        self.late_rows = 0
        self.stats = {"rows": 0, "partial": 0, "lost": 0, "busy_s": 0.0, "cpu_s": 0.0}
        """Figures for benchmarks: rows written, partial ones, entries lost; the gather
        thread's wall and CPU seconds."""
        path = ring_dir() / f"gpulens-{self.m.token}-n{self.node}"
        self._ring_path = path
        self._channel: UpChannel | None = None
        self._thread: threading.Thread | None = None
        if self.is_leader:
            self._ring = NodeRing.create(path, len(self.m.members), RING, agg.RANK_WIDTH)
            self._ring.claim(self.m.slot, rank, os.getpid())
            self._store.set(self.m.prefix + f"ring/{self.node}", str(path))
            with contextlib.suppress(Exception):  # its own connection, where the store can
                self._store = self._store.clone()
            self._channel = UpChannel(self._store, self.m.prefix, self.m.nodes)

    # -- start -------------------------------------------------------------------------------
    @property
    def placement(self) -> tuple[int, int, int]:
        """(global rank, local rank, world size), as the engine's spec has it."""
        return (self.rank, self.m.local_rank, self.world)

    def sinks_for(self, sinks: list[Sink]) -> list[Sink]:
        """The sinks this rank writes: rank 0 all; another node's leader each sink's node
        copy (``sink.for_node(node)``: JSONL, Prometheus), the others none."""
        if self.is_writer:
            return list(sinks)
        if not self.is_leader:
            return []
        out: list[Sink] = []
        for sink in sinks:
            for_node = getattr(sink, "for_node", None)
            copy = for_node(self.node) if for_node is not None else None
            if copy is not None:
                out.append(copy)
        return out

    def shape_before_engine(self) -> JobShape | None:
        """What the engine's context should hold about the job (its sinks open with it): a
        leader's node, rank 0's whole job (waits, bounded, for the others' GPUs); ``None``
        for the other ranks."""
        if not self.is_leader or self._shaped:
            return self.shape
        self._shaped = True
        shape = node_shape(self._store, self.m, self._deadline)
        if self.is_writer:
            shape = job_shape(self._store, self.m, shape, self._deadline)
        self.shape = shape
        return shape

    def bind(self, context: RunContext) -> None:
        """After this rank's engine started: learn its GPU, tell the others, start reading."""
        self._gpu = context.gpus[0].index if context.gpus else self.rank
        job = getattr(context, "job", None)
        if not self.is_leader:
            publish_rank(self._store, self.m, context.gpus)
            key = self.m.prefix + f"ring/{self.node}"
            try:
                self._store.wait([key], _td(max(0.001, self._deadline - time.monotonic())))
                path = Path(self._store.get(key).decode())
                ring = NodeRing.attach(path, len(self.m.members), RING, agg.RANK_WIDTH)
            except Exception as exc:
                logger.warning("gpulens: rank %d could not join its node's gather (%r); its "
                               "rows are not gathered", self.rank, exc)
                return
            ring.claim(self.m.slot, self.rank, os.getpid())
            with self._lock:
                self._ring = ring
            return
        if isinstance(job, JobShape):
            self.shape = job
        if not self.is_writer and self.shape is not None:
            publish_node(self._store, self.m, self.shape.with_gpus(self.rank, context.gpus))
        self._thread = threading.Thread(target=self._work, name="gpulens-gather", daemon=True)
        self._thread.start()

    # -- rows in ---------------------------------------------------------------------------
    def local_row(self, row: Row) -> None:
        """This rank's raw row (the engine's row-back thread), in order."""
        with self._lock:
            if self._closed:
                self.late_rows += 1
                late = True
            else:
                late = False
                if self.is_leader:
                    self._own.append(row)
                elif self._ring is not None:
                    entry = agg.pack_rank(row.step, row.time, row.values, self.rank, self._gpu)
                    self._ring.write(self.m.slot, self._written, entry)
                    self._written += 1
        if late:
            warn_once("gather-late", "gpulens: a row of rank %d came after its gather closed "
                      "at stop and is not written (counted in late_rows)", self.rank)
            return
        if self.is_leader:
            with self._wake:
                self._wake.notify()

    def request(self) -> None:
        """``log()``'s part (the training thread): wakes the leader's thread; never waits."""
        if self.is_leader and not self._closed:
            with self._wake:
                self._wake.notify()

    # -- the leader's thread -------------------------------------------------------------------
    def _work(self) -> None:
        cpu0, t0 = time.thread_time(), time.perf_counter()
        state = _LeaderState(self)
        try:
            while True:
                with self._wake:
                    if self._closed:
                        return
                    self._wake.wait(POLL_S if state.waiting() or self._finishing else None)
                    finishing = self._finishing
                t1, c1 = time.perf_counter(), time.thread_time()
                state.poll(finishing)
                self.stats["busy_s"] += time.perf_counter() - t1
                self.stats["cpu_s"] += time.thread_time() - c1
                if finishing and state.finished():
                    state.finish()
                    return
        except Exception as exc:
            if not self._closed:
                logger.warning("gpulens: rank %d's gather failed (%r); the rows of its node "
                               "are no longer written", self.rank, exc)
        finally:
            self.stats["thread_cpu_s"] = time.thread_time() - cpu0
            self.stats["thread_wall_s"] = time.perf_counter() - t0

    # -- stop ----------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """At stop, after the engine's last rows came back: a rank marks its slot done; a
        leader writes the rows it can still complete (waiting for its ranks and, on rank 0, the
        nodes, while they make progress, at most ``timeout`` s), then :meth:`close`."""
        try:
            if not self.is_leader:
                with self._lock:
                    if self._ring is not None:
                        self._ring.finish(self.m.slot, self._written)
                return
            with self._wake:
                self._finishing = True
                self._wake.notify()
            thread = self._thread
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    logger.warning("gpulens: rank %d's last rows did not meet its ranks' within "
                                   "%.0f s; they are not written", self.rank, timeout or 0.0)
        finally:
            self.close()

    def close(self) -> None:
        """Release the node file (a leader removes it).  Not a collective; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            late = len(self._own) if self._thread is None or not self._thread.is_alive() else 0
            ring, self._ring = self._ring, None
        with self._wake:
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        if ring is not None:
            if not self.is_leader and self._written:
                ring.finish(self.m.slot, self._written)
            ring.close()
        if late and self._finishing is False:
            logger.warning("gpulens: %d row(s) of rank %d were not gathered (stopped without "
                           "the last exchange)", late, self.rank)

    @property
    def closed(self) -> bool:
        return self._closed


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _LeaderState:
    """A leader's book-keeping, on its thread only."""

    def __init__(self, g: JobGather) -> None:
        self.g = g
        m = g.m
        self.slots = [i for i in range(len(m.members)) if i != m.slot]
        self.next_seq = dict.fromkeys(self.slots, 0)
        self.dup: dict[int, tuple[int, int]] = {}
        """slot -> (last step read, its count) for the row keys."""
        self.own_dup = (-1, 0)
        self.pending: dict[Key, _Pending] = {}
        self.order: deque[Key] = deque()
        """Keys of the leader's own rows, in order: the order rows are written in."""
        self.lost = 0
        self.missing_ranks: set[int] = set()
        self.missing_nodes: set[int] = set()
        self.done_nodes: set[int] = set()
        self.best = agg.BestSoFar()
        self.job_order: deque[Key] = deque()
        self.nodes_pending: dict[Key, _Pending] = {}
        self.slots_rank = {i: m.members[i] for i in range(len(m.members))}
        self.written_keys: set[Key] = set()
        """Rank 0: keys whose job row is out (a summary that comes later is dropped)."""
        self.said_nodes: set[int] = set()
        self.said_ranks: set[int] = set()
        self.stall_at: float | None = None

    def waiting(self) -> bool:
        return bool(self.order or self.job_order)

    # -- reading ---------------------------------------------------------------------------
    def _key(self, last: tuple[int, int], step: int) -> tuple[Key, tuple[int, int]]:
        n = last[1] + 1 if last[0] == step else 0
        return (step, n), (step, n)

    def poll(self, finishing: bool) -> None:
        g = self.g
        now = time.monotonic()
        with g._lock:
            own = list(g._own)
            g._own.clear()
            ring = g._ring
        for row in own:
            key, self.own_dup = self._key(self.own_dup, row.step)
            p = self.pending.setdefault(key, _Pending())
            p.own = row
            p.since = now
            p.entries[g.rank] = agg.pack_rank(row.step, row.time, row.values, g.rank, g._gpu)
            self.order.append(key)
        if ring is not None:
            for slot in self.slots:
                self._read_slot(ring, slot, now)
        self._emit_nodes(now, ring)
        if g.is_writer:
            self._take_summaries(now)
            self._emit_job(now, finishing)

    def _read_slot(self, ring: NodeRing, slot: int, now: float) -> None:
        seq = self.next_seq[slot]
        rank = self.slots_rank[slot]
        while True:
            got = ring.read(slot, seq)
            if got is None:
                break
            seq += 1
            if got == LOST:
                self.lost += 1
                self.g.stats["lost"] += 1
                continue
            assert isinstance(got, list)
            step = int(agg.field_of(got, "step"))
            key, self.dup[slot] = self._key(self.dup.get(slot, (-1, 0)), step)
            p = self.pending.setdefault(key, _Pending())
            p.entries[rank] = got
            self.missing_ranks.discard(rank)
        self.next_seq[slot] = seq

    def _expected(self, ring: NodeRing | None) -> tuple[list[int], list[int]]:
        """(ranks to wait for, ranks not to wait for: exited, stopped before, known missing)."""
        wait, skip = [], []
        for slot in self.slots:
            rank = self.slots_rank[slot]
            if ring is None:
                skip.append(rank)
                continue
            state, _, pid, written, final = ring.state(slot)
            read_all = self.next_seq[slot] >= written
            gone = final is not None or (state != 0 and not _alive(pid))
            if (gone and read_all) or rank in self.missing_ranks:
                skip.append(rank)
            else:
                wait.append(rank)
        return wait, skip

    def _emit_nodes(self, now: float, ring: NodeRing | None) -> None:
        while self.order:
            key = self.order[0]
            p = self.pending[key]
            wait, skip = self._expected(ring)
            absent = [r for r in wait if r not in p.entries]
            over = now - p.since >= NODE_WAIT_S or len(self.pending) > MAX_PENDING
            if absent and not over:
                return
            self.order.popleft()
            del self.pending[key]
            missing = sorted(r for r in (*absent, *skip) if r not in p.entries)
            for r in absent:
                self.missing_ranks.add(r)
            self._node_row(key, p, missing)
        # entries of steps the leader never had (its own mark dropped): let them go
        _prune(self.pending, set(self.order))

    def _node_row(self, key: Key, p: _Pending, missing: list[int]) -> None:
        g = self.g
        assert p.own is not None
        summary, node_out = agg.reduce_node(
            g.node, key[1], p.entries, len(g.m.members), missing, self.lost, g.world, self.best)
        summary.seq = key[1]
        if g.is_writer:
            jp = self.nodes_pending.setdefault(key, _Pending())
            jp.own, jp.since, jp.node_out = p.own, time.monotonic(), node_out
            jp.summaries[g.node] = summary
            self.job_order.append(key)
            return
        values = _base(p.own)
        values.update(node_out)
        values.update(summary.work)
        self._told(missing, [], p.own.step)
        _energy_per_step(values, f"node/{g.node}/energy_j_sum")
        g._submit(Row(step=p.own.step, time=p.own.time, values=values))
        g.stats["rows"] += 1
        g.stats["partial"] += bool(missing)
        channel = g._channel
        if channel is not None and not channel.push(g.node, summary.encode(
                agg.featured_slots(g.world))):
            warn_once("gather-full", "gpulens: node %d's figures wait in the store for rank 0 "
                      "(more than %d rows behind); later ones are dropped until it catches up",
                      g.node, 64)

    # -- rank 0 ----------------------------------------------------------------------------
    def _take_summaries(self, now: float) -> None:
        g = self.g
        assert g._channel is not None
        for raw in g._channel.pop_all():
            s = agg.NodeSummary.decode(raw)
            if s.expected < 0:
                self.done_nodes.add(s.node)
                continue
            key = (s.step, s.seq)
            p = self.nodes_pending.get(key)
            if p is None:
                if key in self.written_keys:
                    continue  # its row is out already (written without this node)
                p = self.nodes_pending[key] = _Pending()
            p.summaries[s.node] = s
            _prune(self.nodes_pending, set(self.job_order))
            self.missing_nodes.discard(s.node)

    def _emit_job(self, now: float, finishing: bool) -> None:
        g = self.g
        nodes = range(g.m.nodes)
        while self.job_order:
            key = self.job_order[0]
            p = self.nodes_pending[key]
            wait = [n for n in nodes if n not in self.missing_nodes and n not in self.done_nodes]
            absent = [n for n in wait if n not in p.summaries]
            if absent and now - p.since < JOB_WAIT_S and len(self.nodes_pending) <= MAX_PENDING:
                return
            self.job_order.popleft()
            del self.nodes_pending[key]
            if len(self.written_keys) > 4 * MAX_PENDING:
                self.written_keys.clear()
            self.written_keys.add(key)
            self.missing_nodes.update(absent)
            assert p.own is not None
            summaries = list(p.summaries.values())
            values = _base(p.own)
            values.update({k: v for k, v in p.node_out.items() if not k.startswith("rank/")})
            values.update(agg.merge_job(summaries, g.world, g.m.nodes))
            _energy_per_step(values, "gpu/all/energy_j_sum")
            ranks_missing = sorted({r for s in summaries for r in s.missing})
            self._told(ranks_missing, [n for n in nodes if n not in p.summaries], p.own.step)
            g._submit(Row(step=p.own.step, time=p.own.time, values=values))
            g.stats["rows"] += 1
            g.stats["partial"] += values.get("job/partial", 0.0) > 0

    def _told(self, ranks: list[int], nodes: list[int], step: int) -> None:
        """Say once what a row lacks (rank 0: WARNING; another leader: INFO), and at INFO
        when a rank or node said missing is back (a later absence is said again)."""
        g = self.g
        say = logger.warning if g.is_writer else logger.info
        for n in sorted(self.said_nodes - set(nodes)):
            self.said_nodes.discard(n)
            logger.info("gpulens: node %d sends figures again (step %d)", n, step)
        for r in sorted(self.said_ranks - set(ranks)):
            self.said_ranks.discard(r)
            logger.info("gpulens: rank %d sends rows again (step %d)", r, step)
        for n in nodes:
            if n in self.said_nodes or n in self.done_nodes:
                continue
            self.said_nodes.add(n)
            name = g.shape.node_names().get(n, "?") if g.shape is not None else "?"
            say("gpulens: node %d (%s) sent no figures for step %d within %.0f s; rows from "
                "here on are written without it, marked partial (job/partial = 1)", n, name,
                step, JOB_WAIT_S)
        for r in ranks:
            if r in self.said_ranks:
                continue
            self.said_ranks.add(r)
            where = self._where(r)
            say("gpulens: rank %d%s sent no row for step %d (its process has exited, or it "
                "stalls); rows from here on are written without it, marked partial "
                "(job/partial = 1, job/ranks counts those present)", r, where, step)

    def _where(self, rank: int) -> str:
        shape = self.g.shape
        if shape is None:
            return ""
        for info in shape.ranks:
            if info.rank == rank:
                gpu = f", GPU {info.gpus[0].index}" if info.gpus else ""
                return f" (node {info.node} {info.node_name}, local rank {info.local_rank}{gpu})"
        return ""

    # -- the end ---------------------------------------------------------------------------
    def finished(self) -> bool:
        g = self.g
        ring = g._ring
        if ring is not None:
            for slot in self.slots:
                state, _, pid, written, final = ring.state(slot)
                if self.next_seq[slot] < written and _alive(pid):
                    return False
                if final is None and state != 0 and _alive(pid) and self._stall_ok():
                    return False
        if self.order:
            return False
        if g.is_writer:
            live = [n for n in range(g.m.nodes) if n != g.node and n not in self.done_nodes
                    and n not in self.missing_nodes]
            if (live and self._stall_ok()) or self.job_order:
                return False
        return True

    def _stall_ok(self) -> bool:
        """While finishing: True until :data:`JOB_WAIT_S` passed since finishing began."""
        now = time.monotonic()
        if self.stall_at is None:
            self.stall_at = now
        return now - self.stall_at < JOB_WAIT_S

    def finish(self) -> None:
        g = self.g
        if not g.is_writer and g._channel is not None:
            done = agg.NodeSummary(node=g.node, seq=0, step=0, time=0.0, ranks=0, expected=-1)
            g._channel.push(g.node, done.encode(0))


def _prune(pending: dict[Key, _Pending], keep: set[Key]) -> None:
    """Beyond :data:`MAX_PENDING`, the oldest keys not in ``keep`` go (rows of steps this
    leader never had: its own mark was dropped)."""
    if len(pending) > MAX_PENDING:
        for key in sorted(k for k in pending if k not in keep)[: len(pending) - MAX_PENDING]:
            del pending[key]


def _base(own: Row) -> dict[str, float]:
    """The leader's own row without its GPU and work figures (those come aggregated)."""
    return {k: v for k, v in own.values.items()
            if not k.startswith("gpu/") and k not in WORK_KEYS}


def _energy_per_step(values: dict[str, float], key: str) -> None:
    energy = values.get(key)
    if energy is not None:
        values["perf/energy_per_step_j"] = energy / (values.get("perf/steps", 1.0) or 1.0)
