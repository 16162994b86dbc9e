"""The two levels' book-keeping, each on its rank's gather thread only
(:class:`~gpulens.distributed.rows.RowGather` runs them): :class:`NodeLevel` on a node's
leader, :class:`JobLevel` on rank 0.  Rows are matched by key: (step, how many rows of that
step came before it on the rank), so ranks whose rows come at different moments, or a rank
whose engine dropped a mark, still line up.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpulens.distributed import aggregate as agg
from gpulens.distributed.nodering import LOST, NodeRing, pid_alive
from gpulens.engine.spec import WORK_KEYS
from gpulens.log import logger
from gpulens.model import Row

if TYPE_CHECKING:
    from gpulens.distributed.rows import RowGather

NODE_WAIT_S = 10.0
"""How long a node's leader waits for a rank's row of a step once its own is in."""
JOB_WAIT_S = NODE_WAIT_S + 5.0
"""How long rank 0 waits for a node's summary of a step once its own row is in."""
POLL_S = 0.05
"""How often a leader or rank 0 looks again while a row waits for some rank or node."""
MAX_PENDING = 512
"""Rows held unfinished before the oldest is written as it is."""

Key = tuple[int, int]


@dataclass
class _Pending:
    own: Row | None = None
    entries: dict[int, list[float]] = field(default_factory=dict)
    since: float = math.inf
    """When this rank's own row came: the wait for the others starts there."""
    summaries: dict[int, agg.NodeSummary] = field(default_factory=dict)
    node_out: dict[str, float] = field(default_factory=dict)


EPOCH = 1 << 24
"""A key's ``seq`` is ``epoch * EPOCH + n`` (see :class:`_Keys`); it travels as a float, exact
up to 2**53."""


class _Keys:
    """Keys of one rank's rows, in order: ``(step, seq)``.  ``n`` counts the rows of one step
    logged several times in a row; ``epoch`` counts how often the steps went backwards (a loop
    that counts each epoch's steps from 1, a monitor restarted at step 0).  Every rank logs the
    same steps, so the ranks agree on both, and a key is never used twice (a repeated key made
    the gather fail and stop writing rows)."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._n = 0
        self._epoch = 0

    def next(self, step: int) -> Key:
        if step == self._step:
            self._n += 1
        else:
            if self._step is not None and step < self._step:
                self._epoch += 1
            self._step, self._n = step, 0
        return step, self._epoch * EPOCH + self._n


def _order(key: Key) -> tuple[int, int, int]:
    """A key's place in its rank's sequence of rows: (epoch, step, repeat)."""
    return key[1] // EPOCH, key[0], key[1] % EPOCH


def _alive(pid: int) -> bool:
    """A slot's process: a slot not claimed yet (pid 0) counts as alive (a rank that joins
    late)."""
    return pid <= 0 or pid_alive(pid)


def _prune(pending: dict[Key, _Pending], keep: set[Key]) -> None:
    """Beyond :data:`MAX_PENDING`, the oldest keys not in ``keep`` go (rows of steps this
    rank never had: its own mark was dropped)."""
    if len(pending) > MAX_PENDING:
        for key in sorted(k for k in pending if k not in keep)[: len(pending) - MAX_PENDING]:
            del pending[key]


def base_values(own: Row) -> dict[str, float]:
    """A rank's own row without its GPU and work figures (those come reduced)."""
    return {k: v for k, v in own.values.items()
            if not k.startswith("gpu/") and k not in WORK_KEYS}


def energy_per_step(values: dict[str, float], key: str) -> None:
    energy = values.get(key)
    if energy is not None:
        values["perf/energy_per_step_j"] = energy / (values.get("perf/steps", 1.0) or 1.0)


class _Teller:
    """Says once what rows lack, and when it is back (rank 0: WARNING; a leader: INFO)."""

    def __init__(self, g: RowGather) -> None:
        self.g = g
        self.ranks: set[int] = set()
        self.nodes: set[int] = set()

    def tell(self, ranks: list[int], nodes: list[int], step: int, done: set[int]) -> None:
        g = self.g
        say = logger.warning if g.is_writer else logger.info
        for n in sorted(self.nodes - set(nodes)):
            self.nodes.discard(n)
            logger.info("gpulens: node %d sends figures again (step %d)", n, step)
        for r in sorted(self.ranks - set(ranks)):
            self.ranks.discard(r)
            logger.info("gpulens: rank %d sends rows again (step %d)", r, step)
        for n in nodes:
            if n in self.nodes or n in done:
                continue
            self.nodes.add(n)
            names = g.shape.node_names() if g.shape is not None else {}
            say("gpulens: node %d (%s) sent no figures for step %d within %.0f s; rows from "
                "here on are written without it, marked partial (job/partial = 1)", n,
                names.get(n, "?"), step, JOB_WAIT_S)
        for r in ranks:
            if r in self.ranks or r in g.misstepped:  # said already, as what it is
                continue
            self.ranks.add(r)
            why = ("its monitor was stopped" if r in g.stopped
                   else "its process has exited, or it stalls")
            say("gpulens: rank %d%s sent no row for step %d (%s); rows from here on are "
                "written without it, marked partial (job/partial = 1, job/ranks counts the "
                "ranks present)", r, self._where(r), step, why)

    def _where(self, rank: int) -> str:
        shape = self.g.shape
        for info in shape.ranks if shape is not None else ():
            if info.rank == rank:
                gpu = f", GPU {info.gpus[0].index}" if info.gpus else ""
                return f" (node {info.node} {info.node_name}, local rank {info.local_rank}{gpu})"
        return ""


class NodeLevel:
    """A leader's: its node's entries -> node summaries (and node rows)."""

    def __init__(self, g: RowGather) -> None:
        self.g = g
        m = g.m
        self.slots = [i for i in range(len(m.members)) if i != m.slot]
        self.rank_of = {i: m.members[i] for i in range(len(m.members))}
        self.next_seq = dict.fromkeys(self.slots, 0)
        self.keys = {i: _Keys() for i in self.slots}
        self.last_key: dict[int, Key] = {}
        """Each slot's latest row read: an earlier key it lacks will not come."""
        self.own_keys = _Keys()
        self.pending: dict[Key, _Pending] = {}
        self.order: deque[Key] = deque()
        self.missing: set[int] = set()
        self.lost = 0
        self.best = agg.BestSoFar()
        self.teller = _Teller(g)
        self.stall_at: float | None = None

    def waiting(self) -> bool:
        return bool(self.order)

    def poll(self) -> list[tuple[agg.NodeSummary, dict[str, float]]]:
        g = self.g
        now = time.monotonic()
        for row in g.take_own(job=False):
            key = self.own_keys.next(row.step)
            p = self.pending.setdefault(key, _Pending())
            p.own, p.since = row, now
            p.entries[g.rank] = agg.pack_rank(row.step, row.time, row.values, g.rank, g.gpu,
                                              g.node)
            self.order.append(key)
        ring = g.ring
        if ring is not None:
            for slot in self.slots:
                self._read(ring, slot)
        out = []
        while self.order:
            key = self.order[0]
            p = self.pending[key]
            # the slots' states (a pid look each) only for a row that lacks some rank
            lacking = [s for s in self.slots if self.rank_of[s] not in p.entries]
            absent = self._awaited(ring, lacking, key)
            if absent and now - p.since < NODE_WAIT_S and len(self.pending) <= MAX_PENDING:
                break
            self.order.popleft()
            del self.pending[key]
            self.missing.update(absent)
            out.append(self._reduce(key, p, sorted(self.rank_of[s] for s in lacking)))
        _prune(self.pending, set(self.order))
        return out

    def _read(self, ring: NodeRing, slot: int) -> None:
        seq = self.next_seq[slot]
        rank = self.rank_of[slot]
        while True:
            got = ring.read(slot, seq)
            if got is None:
                break
            seq += 1
            if got == LOST or not isinstance(got, list):
                self.lost += 1
                self.g.stats["lost"] += 1
                continue
            key = self.keys[slot].next(int(agg.field_of(got, "step")))
            self.last_key[slot] = key
            self.pending.setdefault(key, _Pending()).entries[rank] = got
            self.missing.discard(rank)
        self.next_seq[slot] = seq

    def _awaited(self, ring: NodeRing | None, slots: list[int], key: Key) -> list[int]:
        """The ranks of ``slots`` (each lacking the row ``key``) still to wait for: not those
        whose writer exited or stopped with every entry read, nor those said missing already,
        nor those that sent a later row (a rank's rows come in order: it did not log this
        step; said once as what it is)."""
        if ring is None:
            return []
        wait = []
        for slot in slots:
            rank = self.rank_of[slot]
            last = self.last_key.get(slot)
            if last is not None and _order(last) > _order(key):
                if rank not in self.g.misstepped:
                    self.g.misstepped.add(rank)
                    logger.warning(
                        "gpulens: rank %d%s logged step %d but not step %d, which rank %d "
                        "logged: the ranks call log() at different steps (every rank must "
                        "log the same steps; or its mark was dropped); rows of a step a rank "
                        "did not log are written without its GPU, marked partial "
                        "(job/partial = 1)", rank, self.teller._where(rank), last[0], key[0],
                        self.g.rank)
                continue
            state, _, pid, written, final = ring.state(slot)
            if self.next_seq[slot] >= written and final is not None:
                self.g.stopped.add(rank)
            if rank in self.missing or (self.next_seq[slot] >= written and (
                    final is not None or (state != 0 and not _alive(pid)))):
                continue
            wait.append(rank)
        return wait

    def _reduce(self, key: Key, p: _Pending, missing: list[int]
                ) -> tuple[agg.NodeSummary, dict[str, float]]:
        g = self.g
        assert p.own is not None
        summary, node_out = agg.reduce_node(g.node, key[1], p.entries, len(g.m.members),
                                            missing, self.lost, g.world, self.best, g.full)
        if not g.is_writer:
            self.teller.tell(missing, [], p.own.step, set())
        if g.scaled and not g.is_writer:  # the node's row, for its own sinks
            values = base_values(p.own)
            values.update(node_out)
            values.update(summary.work)
            energy_per_step(values, f"node/{g.node}/energy_j_sum")
            g.submit(Row(step=p.own.step, time=p.own.time, values=values))
            g.stats["rows"] += 1
            g.stats["partial"] += bool(missing)
        return summary, node_out

    def finished(self) -> bool:
        """At stop: every rank of the node stopped (or exited) and was read, every row out;
        or :data:`JOB_WAIT_S` has passed since stop began."""
        if self.order and not self._stalled():
            return False
        ring = self.g.ring
        for slot in self.slots if ring is not None else ():
            assert ring is not None
            state, _, pid, written, final = ring.state(slot)
            alive = state != 0 and _alive(pid)
            if alive and (final is None or self.next_seq[slot] < written) and not self._stalled():
                return False
        return not self.order

    def _stalled(self) -> bool:
        now = time.monotonic()
        if self.stall_at is None:
            self.stall_at = now
        return now - self.stall_at >= JOB_WAIT_S


class JobLevel:
    """Rank 0's: its own rows and the nodes' summaries -> the job's rows."""

    def __init__(self, g: RowGather) -> None:
        self.g = g
        self.own_keys = _Keys()
        self.pending: dict[Key, _Pending] = {}
        self.order: deque[Key] = deque()
        self.missing: set[int] = set()
        self.done: set[int] = set()
        self.written: set[Key] = set()
        self.teller = _Teller(g)
        self.stall_at: float | None = None

    def waiting(self) -> bool:
        return bool(self.order)

    def due(self) -> float | None:
        """Seconds until the oldest row's wait for the nodes runs out (``None``: no row)."""
        if not self.order:
            return None
        return self.pending[self.order[0]].since + JOB_WAIT_S - time.monotonic()

    def add(self, summary: agg.NodeSummary, node_out: dict[str, float]) -> None:
        """A node summary from this rank's own node level (rank 0 leads a node of one)."""
        p = self.pending.setdefault((summary.step, summary.seq), _Pending())
        p.summaries[summary.node] = summary
        p.node_out = node_out

    def poll(self) -> None:
        g = self.g
        now = time.monotonic()
        for row in g.take_own(job=True):
            key = self.own_keys.next(row.step)
            p = self.pending.setdefault(key, _Pending())
            p.own, p.since = row, now
            self.order.append(key)
        for raw in g.take_rx():
            s = agg.NodeSummary.decode(raw)
            if s.expected < 0:
                self.done.add(s.node)
                continue
            key = (s.step, s.seq)
            if key in self.written:
                continue  # its row is out already, written without this node
            self.pending.setdefault(key, _Pending()).summaries[s.node] = s
            self.missing.discard(s.node)
        nodes = range(g.m.nodes)
        while self.order:
            key = self.order[0]
            p = self.pending[key]
            absent = [n for n in nodes if n not in p.summaries and n not in self.missing
                      and n not in self.done]
            if absent and now - p.since < JOB_WAIT_S and len(self.pending) <= MAX_PENDING:
                break
            self.order.popleft()
            del self.pending[key]
            if len(self.written) > 4 * MAX_PENDING:
                self.written.clear()
            self.written.add(key)
            self.missing.update(absent)
            self._write(p, [n for n in nodes if n not in p.summaries])
        _prune(self.pending, set(self.order))

    def _write(self, p: _Pending, lacking: list[int]) -> None:
        g = self.g
        assert p.own is not None
        summaries = list(p.summaries.values())
        values = base_values(p.own)
        values.update({k: v for k, v in p.node_out.items() if not k.startswith("rank/")})
        values.update(agg.merge_job(summaries, g.world, g.m.nodes, g.full))
        energy_per_step(values, "gpu/all/energy_j_sum")
        ranks = sorted({r for s in summaries for r in s.missing})
        self.teller.tell(ranks, lacking, p.own.step, self.done)
        g.submit(Row(step=p.own.step, time=p.own.time, values=values))
        g.stats["rows"] += 1
        g.stats["partial"] += values.get("job/partial", 0.0) > 0

    def finished(self) -> bool:
        """At stop: every node said it is done (or is missing) and every row is out; or
        :data:`JOB_WAIT_S` has passed since stop began."""
        now = time.monotonic()
        if self.stall_at is None:
            self.stall_at = now
        if now - self.stall_at >= JOB_WAIT_S:
            return not self.order or self._flush_all()
        others = [n for n in range(self.g.m.nodes) if n not in self.done
                  and n not in self.missing and not (self.g.is_leader and n == self.g.node)]
        return not others and not self.order

    def _flush_all(self) -> bool:
        """Write what is left as it is (the wait at stop ran out)."""
        while self.order:
            key = self.order.popleft()
            p = self.pending.pop(key)
            self._write(p, [n for n in range(self.g.m.nodes) if n not in p.summaries])
        return True
