"""The two-level gather in one process: each "rank" is a :class:`JobGather` made in a thread of
its own over one in-memory store (``torch.distributed.HashStore``), with real node files in
``/dev/shm``; in a job of one node each rank's per-row work is a :class:`RowGather` made from
its plan, as its engine makes it.  Fast; waits on rows, never on the clock.  The same code
under two real ``torchrun`` launches: ``tests/test_integration_distributed.py``."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from gpulens.distributed import aggregate as agg  # noqa: E402
from gpulens.distributed import levels  # noqa: E402
from gpulens.distributed.channel import UpChannel  # noqa: E402
from gpulens.distributed.gather import JobGather  # noqa: E402
from gpulens.distributed.nodering import LOST, NodeRing, pid_alive, sweep_stale  # noqa: E402
from gpulens.distributed.rows import GatherPlan, RowGather  # noqa: E402
from gpulens.distributed.topology import Placement, placement_from_env  # noqa: E402
from gpulens.log import reset_warnings  # noqa: E402
from gpulens.model import GpuInfo, Row, RunContext  # noqa: E402

WAIT_S = 30.0
"""Bounds a hang only."""


class Job:
    """``world`` ranks over ``nodes`` nodes, each a JobGather made in its own thread."""

    def __init__(self, world: int, nodes: int, generation: int = 1, tcp: bool = False,
                 held: tuple[int, ...] = ()) -> None:
        """``tcp``: the job's store is a ``TCPStore`` (each rank a client of its own, as the
        launchers give): the engines then gather a job of several nodes themselves.
        ``held``: ranks whose engine's per-row work starts only at :meth:`start_engine` (an
        engine slower to start than its training process)."""
        self.server: Any = None
        if tcp:
            self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.store = dist.HashStore() if not tcp else None
        self.world = world
        self.rows: dict[int, list[Row]] = {r: [] for r in range(world)}
        self.g: dict[int, JobGather] = {}
        per = world // nodes

        def make(r: int) -> None:
            place = Placement(rank=r, world=world, local_rank=r % per, node_index=r // per,
                              node_name=f"node{r // per}", launcher="test")
            store = self.store if self.server is None else dist.PrefixStore(
                "default_pg", dist.TCPStore("127.0.0.1", self.server.port, is_master=False))
            self.g[r] = JobGather(self.rows[r].append, store=store, placement=place,
                                  timeout=WAIT_S, generation=generation)

        self._parallel(make)
        self.shapes: dict[int, Any] = {}
        self.w: dict[int, RowGather] = {}
        """Each rank's per-row work: its engine's (one node, made here as the engine makes
        it) or its JobGather's (several nodes)."""

        self.plans: dict[int, GatherPlan] = {}

        def start(r: int) -> None:
            g = self.g[r]
            self.shapes[r] = g.shape_before_engine()
            plan = g.engine_plan()  # as Monitor.start hands it to the engine
            gpu = GpuInfo(index=r, name="sim", uuid=f"GPU-{r}", pci_bus_id=f"0:{r}")
            g.bind(RunContext(gpus=(gpu,), hostname="h", backend="simulated",
                              interval=0.1, job=self.shapes[r]))
            if plan is not None:  # as the engine makes it
                self.plans[r] = plan
                if r not in held:
                    self.start_engine(r)
            elif g.work is not None:
                self.w[r] = g.work
            # else: this rank could not join its node's file (said); its rows go nowhere

        self._parallel(start)

    def start_engine(self, r: int) -> None:
        """Rank ``r``'s engine's per-row work, as the engine makes it."""
        self.w[r] = self.plans[r].gather(self.rows[r].append, gpu=r, shape=self.shapes[r])

    def _parallel(self, fn: Any) -> None:
        threads = [threading.Thread(target=fn, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)

    def log(self, step: int, ranks: Any = None, busy: dict[int, float] | None = None) -> None:
        for r in ranks if ranks is not None else range(self.world):
            if r in self.w:
                self.w[r].local_row(self.row(r, step, busy))

    @staticmethod
    def row(r: int, step: int, busy: dict[int, float] | None = None) -> Row:
        """Rank ``r``'s raw row of ``step``."""
        sm = (busy or {}).get(r, 50.0 + r)
        values = {f"gpu/{r}/util_pct": 60.0 + r, f"gpu/{r}/sm_active_pct": sm,
                  f"gpu/{r}/power_w": 100.0 + r, f"gpu/{r}/energy_j": 10.0,
                  "perf/steps": 1.0, "perf/step_time_s": 0.5, "work/cpu_s": 0.1,
                  "work/tokens": 8.0, "train/loss": 1.0 / step,
                  "train/global_step": float(step)}
        return Row(step=step, time=float(step), values=values)

    def wait_rows(self, rank: int, n: int) -> list[Row]:
        deadline = time.monotonic() + WAIT_S
        while len(self.rows[rank]) < n:
            assert time.monotonic() < deadline, f"rank {rank}: {len(self.rows[rank])} rows"
            time.sleep(0.01)
        return self.rows[rank]

    def stop(self, timeout: float = WAIT_S) -> None:
        def stop(r: int) -> None:
            if r in self.w:
                self.w[r].flush(timeout)  # an engine's stop, or its JobGather's
            self.g[r].flush(timeout)

        self._parallel(stop)


@pytest.fixture
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(levels, "NODE_WAIT_S", 0.3)
    monkeypatch.setattr(levels, "JOB_WAIT_S", 2.5)  # beyond the node's wait, as in production


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    reset_warnings()
    yield


# -- topology ----------------------------------------------------------------------------------
def test_placement_from_each_launcher() -> None:
    torchrun = placement_from_env(5, 8, {"GROUP_RANK": "1", "LOCAL_RANK": "1",
                                         "TORCHELASTIC_RUN_ID": "x", "NODE_RANK": "7"})
    assert (torchrun.node_index, torchrun.local_rank, torchrun.launcher) == (1, 1, "torchrun")
    slurm = placement_from_env(3, 4, {"SLURM_NODEID": "1", "SLURM_LOCALID": "1",
                                      "SLURMD_NODENAME": "gpu-017"})
    assert (slurm.node_index, slurm.local_rank, slurm.node_name) == (1, 1, "gpu-017")
    assert slurm.launcher == "slurm"
    # srun torchrun: torchrun's own numbering wins over Slurm's node id
    both = placement_from_env(2, 4, {"SLURM_NODEID": "0", "GROUP_RANK": "1", "LOCAL_RANK": "0"})
    assert (both.node_index, both.launcher) == (1, "torchrun")
    lightning = placement_from_env(2, 4, {"NODE_RANK": "1", "LOCAL_RANK": "0"})
    assert (lightning.node_index, lightning.launcher) == (1, "lightning")
    named = placement_from_env(1, 2, {"GPULENS_NODE_NAME": "fake-b", "LOCAL_RANK": "0"})
    assert (named.node_index, named.node_name, named.node_key) == (None, "fake-b", "hfake-b")


def test_nodes_known_only_by_name_are_numbered_by_name() -> None:
    store = dist.HashStore()
    out: dict[int, Any] = {}

    def join(r: int) -> None:
        from gpulens.distributed.start import join as do_join

        place = Placement(rank=r, world=4, local_rank=None, node_index=None,
                          node_name="b-host" if r < 2 else "a-host", launcher="unknown")
        out[r] = do_join(store, place, 1, WAIT_S)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [out[r].node for r in range(4)] == [1, 1, 0, 0]
    assert out[0].members == (0, 1) and out[3].members == (2, 3)
    assert [out[r].local_rank for r in range(4)] == [0, 1, 0, 1]
    # the leader is a node's second rank: rank 0 merges the nodes and reduces none
    assert (out[1].is_leader, out[0].is_leader, out[3].is_leader) == (True, False, True)


# -- the two levels --------------------------------------------------------------------------
@pytest.mark.parametrize("tcp", [False, True], ids=["hash-store", "tcp-store"])
def test_two_nodes_rows_meet_on_rank_0(tcp: bool) -> None:
    """Two nodes of two ranks. On the launchers' kind of store (a ``TCPStore`` under torch's
    ``PrefixStore``) every rank's engine gathers, the leaders' and rank 0's over connections of
    their own to the store's host and port: no training process does per-row work or runs a
    thread of the gather. A store no other process can open (a ``HashStore``) leaves it to
    the training processes. The rows are the same."""
    job = Job(world=4, nodes=2, tcp=tcp)
    if tcp:
        address = ("127.0.0.1", job.server.port)
        assert all(job.g[r].in_engine and job.g[r].work is None for r in range(4))
        assert all(job.g[r].store_address == address for r in range(4))
    else:
        assert not any(job.g[r].in_engine for r in range(4))
        assert job.g[0].work is not None and job.g[1].work is not None
    assert [job.g[r].is_leader for r in range(4)] == [False, True, False, True]
    shape = job.shapes[0]
    assert [(r.rank, r.node, r.node_name) for r in shape.ranks] == [
        (0, 0, "node0"), (1, 0, "node0"), (2, 1, "node1"), (3, 1, "node1")]
    assert all(r.gpus for r in shape.ranks if r.rank != 0)  # rank 0's engine adds its own
    for step in (1, 2, 3):
        job.log(step)
    rows = job.wait_rows(0, 3)
    job.stop()
    assert [r.step for r in rows] == [1, 2, 3]
    v = rows[-1].values
    assert (v["job/ranks"], v["job/nodes"], v["job/world"], v["job/partial"]) == (4, 2, 4, 0)
    assert all(f"gpu/{r}/util_pct" in v for r in range(4))  # a small job: every GPU
    assert v["gpu/all/util_pct_mean"] == pytest.approx(61.5)
    assert v["gpu/all/power_w_sum"] == pytest.approx(406.0)
    assert v["node/1/util_pct_mean"] == pytest.approx(62.5)
    assert v["work/tokens"] == 32.0  # the job's work, for the engine to finish
    assert v["perf/energy_per_step_j"] == pytest.approx(40.0)
    assert v["train/loss"] == pytest.approx(1 / 3)  # rank 0's own scalars
    assert v["rank/3/gpu_relative_score"] == pytest.approx(50.0 / 53.0)
    # in a small job the node leaders write nothing of their own: rank 0's row has it all
    assert not any(job.rows[r] for r in (1, 2, 3))
    channel = job.w[1].channel  # node 0's leader pushed its summaries through the store
    assert channel is not None and channel.bytes_out > 0


def test_rank_0s_engine_leaves_no_thread_waiting_on_the_store_at_stop() -> None:
    """Rank 0's engine waits for the nodes' summaries in a blocking pop on a connection of
    its own; its gather loop holds no connection, so the stop opens one to wake that pop: no
    thread is left waiting on the store."""
    job = Job(world=4, nodes=2, tcp=True)
    w = job.w[0]
    try:
        deadline = time.monotonic() + WAIT_S
        while w._rx_channel is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the receiving thread connected and waits in its pop
        assert w._rx_thread is not None and w._channel is None
        w.close()
        assert not w._rx_thread.is_alive()
    finally:
        job.stop()


def hold_the_leaders_connections(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The leaders' engines' connections to the job's store open only once the returned
    event is set (an import of torch on a busy host, made as long as a test needs)."""
    from gpulens.distributed import rows

    release = threading.Event()
    real = rows.connect_store

    def held_for_the_leaders(address: Any, timeout: float = 60.0) -> Any:
        if threading.current_thread().name == "gpulens-gather-connect":
            release.wait(WAIT_S)
        return real(address, timeout)

    monkeypatch.setattr(rows, "connect_store", held_for_the_leaders)
    return release


@pytest.mark.parametrize("kept", [64, 2])
def test_a_leaders_summaries_wait_for_its_connection_to_the_store(
        kept: int, fast_waits: None, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader's engine opens its connection beside its gather loop (the import of torch and
    the connect take seconds); the summaries it makes meanwhile are sent, in order, once it is
    open: no row is partial for it. Beyond ``kept`` of them the oldest are dropped, counted and
    said once, and those rows are written partial."""
    from gpulens.distributed import rows

    monkeypatch.setattr(rows, "MAX_QUEUED_PER_NODE", kept)
    # rank 0 waits this long for a node's summary: longer than the held connection can take
    # on a loaded machine (2.5 s made every row partial once, in the full suite on 2 cores)
    monkeypatch.setattr(levels, "JOB_WAIT_S", 8.0)
    release = hold_the_leaders_connections(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job = Job(world=4, nodes=2, tcp=True)
        for step in (1, 2, 3, 4):
            job.log(step)
        leaders = (job.w[1], job.w[3])
        deadline = time.monotonic() + WAIT_S
        while any(len(w._unsent) + w.stats["unsent_dropped"] < 4 for w in leaders):
            assert time.monotonic() < deadline  # each leader made its 4 summaries, unsent
            time.sleep(0.01)
        assert all(w.channel is None for w in leaders)
        release.set()
        got = job.wait_rows(0, 4)
        job.stop()
    whole = [(s, 4, 0) for s in (1, 2, 3, 4)]
    said = [r for r in caplog.records if "wait for a connection" in r.getMessage()]
    if kept >= 4:
        assert [(r.step, r.values["job/ranks"], r.values["job/partial"]) for r in got] == whole
        assert not said
    else:
        assert [(r.step, r.values["job/partial"]) for r in got] == [(1, 1), (2, 1), (3, 0),
                                                                      (4, 0)]
        assert [w.stats["unsent_dropped"] for w in leaders] == [2, 2] and len(said) == 1


@pytest.mark.parametrize("opens,stop_s", [(True, WAIT_S), (False, WAIT_S), (False, 1.5)],
                         ids=["opens-during-stop", "never-opens", "never-opens-short-stop"])
def test_a_leaders_connection_that_opens_during_its_stop_still_sends_its_rows(
        opens: bool, stop_s: float, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A monitor shorter than a leader's connect (a ``with`` block around an evaluation; the
    import of torch in a busy host's engine: seconds).  The leader waits for its connection
    at stop while rank 0 waits for the node, not a fixed few seconds: every row is whole.  (It
    waited ``REACH_S``, 5 s, and dropped every summary of a short monitor: a two-node test
    job on a loaded CI machine wrote its rows without a node.)  A connection that does not
    open by then: the leader says how many rows of figures it could not send; a stop given a
    shorter time-out than rank 0's wait is kept to it, and says the same."""
    from gpulens.distributed import rows

    monkeypatch.setattr(rows, "REACH_S", 0.2)  # the old wait, made short
    monkeypatch.setattr(levels, "NODE_WAIT_S", 0.3)
    monkeypatch.setattr(levels, "JOB_WAIT_S", 8.0 if opens or stop_s < 8.0 else 1.0)
    release = hold_the_leaders_connections(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job = Job(world=4, nodes=2, tcp=True)
        for step in (1, 2, 3):
            job.log(step)
        leaders = (job.w[1], job.w[3])

        def open_during_the_stop() -> None:
            deadline = time.monotonic() + WAIT_S
            while not all(w._finishing for w in leaders) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.0)  # beyond the old wait (REACH_S, made 0.2 s here)
            release.set()

        if opens:  # the connections open a second into the leaders' stop
            threading.Thread(target=open_during_the_stop, daemon=True).start()
        t0 = time.monotonic()
        job.stop(stop_s)
        stopped_s = time.monotonic() - t0
        release.set()
    got = [(r.step, r.values["job/nodes"], r.values["job/partial"]) for r in job.rows[0]]
    said = [r.getMessage() for r in caplog.records if "were not sent" in r.getMessage()]
    unmet = [r.getMessage() for r in caplog.records if "did not meet" in r.getMessage()]
    if opens:
        assert got == [(1, 2, 0), (2, 2, 0), (3, 2, 0)]
        assert not said and not unmet
        return
    assert len(said) == 2 and all("last 3 rows" in m for m in said), said
    assert [job.w[r].stats["unsent_dropped"] for r in (1, 3)] == [3, 3]
    if stop_s >= 8.0:
        assert [(s, p) for s, _, p in got] == [(1, 1), (2, 1), (3, 1)]
        assert not unmet
    else:  # each stop kept to its time-out, not rank 0's 8 s wait: the leaders say what they
        # could not send; rank 0, whose rows still wait for the nodes, that they are not written
        assert stopped_s < 6.0, stopped_s
        assert got == [] and len(unmet) == 1 and "rank 0's last 3 rows" in unmet[0], unmet


def test_a_store_a_leader_cannot_reach_is_said_once_and_rows_go_on_partial(
        fast_waits: None, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leaders' engines cannot connect to the job's store: said once, within seconds (a
    plain TCP connect first), and rank 0 writes its rows without those nodes, marked
    partial; training is never stopped."""
    from gpulens.distributed import rows

    real = rows.connect_store

    def refused_for_the_leaders(address: Any, timeout: float = 60.0) -> Any:
        if threading.current_thread().name == "gpulens-gather-connect":
            raise ConnectionRefusedError("refused")
        return real(address, timeout)

    monkeypatch.setattr(rows, "connect_store", refused_for_the_leaders)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job = Job(world=4, nodes=2, tcp=True)
        job.log(1)
        got = job.wait_rows(0, 1)
        job.stop()
    assert [(r.step, r.values["job/partial"]) for r in got] == [(1, 1)]
    said = [r.getMessage() for r in caplog.records if "cannot reach the job's store" in
            r.getMessage()]
    assert len(said) == 1 and "its node's figures do not reach rank 0" in said[0], said
    # said once: not again at stop as figures that were not sent
    assert not [r for r in caplog.records if "were not sent" in r.getMessage()]


def test_only_a_tcp_store_is_opened_from_an_engine() -> None:
    from gpulens.distributed.rows import store_address

    assert store_address(dist.HashStore()) is None
    assert store_address(dist.PrefixStore("p", dist.HashStore())) is None
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nested = dist.PrefixStore("a", dist.PrefixStore("b", server))
    assert store_address(nested) == ("127.0.0.1", server.port)


def test_a_two_rank_job_is_gathered_by_rank_0s_engine(caplog: pytest.LogCaptureFixture) -> None:
    """One node of two ranks: the engines gather. Rank 0's leads the node and writes the
    job's row in the same pass; no summary goes through the store, the other rank's runs no
    gather thread, and no training process does any per-row work (under DDP each thread's
    Python there is time the step loses). A rank that exits is still told once and its rows
    are marked partial."""
    job = Job(world=2, nodes=1)
    assert [job.g[r].is_leader for r in range(2)] == [True, False]
    assert all(job.g[r].in_engine and job.g[r].work is None for r in range(2))
    assert job.w[0].channel is None and job.w[0]._rx_thread is None
    assert job.w[1]._thread is None and job.w[1].channel is None
    assert job.shapes[0].ranks[1].gpus  # the run's metadata has the other rank's GPU
    for step in (1, 2, 3):
        job.log(step)
    rows = job.wait_rows(0, 3)
    v = rows[-1].values
    assert (v["job/ranks"], v["job/nodes"], v["job/world"], v["job/partial"]) == (2, 1, 2, 0)
    assert all(f"gpu/{r}/util_pct" in v for r in range(2))
    assert v["gpu/all/util_pct_mean"] == pytest.approx(60.5)
    assert v["gpu/all/power_w_sum"] == pytest.approx(201.0)
    assert v["work/tokens"] == 16.0 and v["train/loss"] == pytest.approx(1 / 3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ring = job.g[1].ring
    assert ring is not None
    ring.claim(job.g[1].m.slot, 1, dead.pid)  # rank 1 "exits"
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        for step in (4, 5):
            job.log(step, ranks=[0])
        rows = job.wait_rows(0, 5)
        job.stop()
    assert [(r.values["job/ranks"], r.values["job/partial"]) for r in rows[3:]] == [(1, 1)] * 2
    assert len([r for r in caplog.records if "rank 1 " in r.getMessage()]) == 1
    assert [r.step for r in rows] == [1, 2, 3, 4, 5] and not job.rows[1]


def test_a_rank_whose_training_process_exited_is_waited_for_while_its_engine_writes(
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 logs steps 1-3 and exits while its engine still has their rows on the way (a
    loaded host). The slot's writer is the engine, which says its pid as it opens the node's
    file, so rank 0 waits for the engine rather than judging rank 1 by its exited training
    process: steps 1-3 are whole; step 4, after rank 1's engine ended, is partial and said
    once. (CI, once: the slot held the training process's pid, and step 1 was written
    partial.)"""
    job = Job(world=2, nodes=1, held=(1,))
    ring = job.g[0].ring
    assert ring is not None and 1 not in job.w
    slot = job.g[1].m.slot
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ring.claim(slot, 1, dead.pid)  # as the training process claimed it; it has exited since
    job.start_engine(1)
    assert ring.state(slot)[2] == os.getpid()  # the engine said it writes the slot
    for step in (1, 2, 3):
        job.log(step, ranks=[0])
    time.sleep(1.0)  # rank 0's gather polls every 50 ms: it waits, it writes nothing
    assert job.rows[0] == []
    for step in (1, 2, 3):
        job.w[1].local_row(Job.row(1, step))  # rank 1's rows, late
    job.w[1].flush(WAIT_S)  # and its engine ends
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job.log(4, ranks=[0])
        rows = job.wait_rows(0, 4)
        job.stop()
    assert [(r.values["job/ranks"], r.values["job/partial"]) for r in rows] == [
        (2, 0), (2, 0), (2, 0), (1, 1)]
    told = [r.getMessage() for r in caplog.records if "rank 1 " in r.getMessage()]
    assert len(told) == 1 and "step 4" in told[0], told


@pytest.mark.parametrize(("world", "full"), [(3, None), (8, None), (2, "1")])
def test_rank_0_s_engine_leads_one_node_but_not_the_large_view(
        world: int, full: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three or eight ranks on one node: rank 0's engine leads (the engines' Python is not
    the training processes'). Two ranks with the large view (``GPULENS_FULL_GPUS=1``): the
    node's row (every GPU, for the node's own sinks) and the job's (aggregates) differ, so
    the second rank leads and writes node rows, and the training processes gather."""
    if full is not None:
        monkeypatch.setenv("GPULENS_FULL_GPUS", full)
    job = Job(world=world, nodes=1)
    if full is None:
        assert [job.g[r].is_leader for r in range(world)] == [True] + [False] * (world - 1)
        assert all(job.g[r].in_engine for r in range(world))
        assert job.w[0]._thread is not None and job.w[0]._rx_thread is None
    else:
        assert [job.g[r].is_leader for r in range(world)] == [False, True]
        assert not any(job.g[r].in_engine for r in range(world))
        assert job.w[0]._rx_thread is not None and job.w[1]._thread is not None
    job.log(1)
    rows0 = job.wait_rows(0, 1)
    node_rows = job.wait_rows(1, 1) if full is not None else []
    job.stop()
    assert rows0[0].values["job/ranks"] == world
    if full is not None:
        assert not any(k.startswith("gpu/0/") for k in rows0[0].values)
        assert {k.split("/")[1] for k in node_rows[0].values if k.startswith("gpu/")} >= {
            "0", "1"}


def test_steps_that_go_backwards_keep_the_gather_going() -> None:
    """A loop that counts each epoch's steps from 1 (or logs a step twice) gets every row: the
    keys (step, seq) stay distinct (a repeated key made the gather fail, once, for good)."""
    job = Job(world=4, nodes=2)
    steps = [1, 2, 3, 1, 2, 3, 3, 1]
    for step in steps:
        job.log(step)
    rows = job.wait_rows(0, len(steps))
    job.stop()
    assert [r.step for r in rows] == steps
    assert all(r.values["job/ranks"] == 4 and r.values["job/partial"] == 0 for r in rows)


def test_keys_count_repeats_and_epochs() -> None:
    keys = levels._Keys()
    got = [keys.next(s) for s in (5, 6, 6, 2, 7, 7, 1)]
    e = levels.EPOCH
    assert got == [(5, 0), (6, 0), (6, 1), (2, e), (7, e), (7, e + 1), (1, 2 * e)]
    assert float(2 * e + 1) == 2 * e + 1  # the wire's float keeps it exact


def test_a_large_job_gives_rank_0_aggregates_and_slots_not_every_gpu() -> None:
    job = Job(world=12, nodes=2)
    job.log(1, busy={7: 95.0, 4: 5.0})
    rows0 = job.wait_rows(0, 1)
    node_rows = {r: job.wait_rows(r, 1) for r in (1, 7)}  # the leaders: ranks 1 and 7
    job.stop()
    v = rows0[0].values
    assert not any(k.startswith(f"gpu/{i}/") for i in range(12) for k in v)
    assert v["job/ranks"] == 12 and v["gpu/all/sm_active_pct_min"] == 5.0
    assert (v["gpu/worst1/gpu"], v["gpu/worst1/node"], v["gpu/worst1/sm_active_pct"]) == (
        4.0, 0.0, 5.0)
    assert (v["rank/slowest1/rank"], v["rank/slowest1/node"]) == (7.0, 1.0)
    assert v["node/worst1/node"] == 0.0
    # each node's leader writes its own node's GPUs
    assert {k.split("/")[1] for k in node_rows[7][0].values if k.startswith("gpu/")} == {
        str(r) for r in range(6, 12)}
    assert node_rows[1][0].values["node/0/ranks"] == 6


def test_a_rank_that_exited_is_told_once_and_rows_go_on_partial(
        caplog: pytest.LogCaptureFixture) -> None:
    job = Job(world=4, nodes=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ring = job.g[2].ring  # rank 2 "dies": its slot now names a process that has exited
    assert ring is not None
    ring.claim(job.g[2].m.slot, 2, dead.pid)
    with caplog.at_level(logging.INFO, logger="gpulens"):
        for step in (1, 2, 3):
            job.log(step, ranks=[0, 1, 3])
        rows = job.wait_rows(0, 3)
        job.stop()
    assert [(r.values["job/ranks"], r.values["job/partial"]) for r in rows] == [(3, 1)] * 3
    told = [r for r in caplog.records if "rank 2 " in r.getMessage()
            and r.levelno == logging.WARNING]
    assert len(told) == 1 and "node 1 node1" in told[0].getMessage()


def test_a_stalled_rank_is_waited_for_once_then_not(
        fast_waits: None, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(world=4, nodes=2)
    with caplog.at_level(logging.INFO, logger="gpulens"):
        for step in range(1, 5):
            job.log(step, ranks=[0, 1, 3])  # rank 2 (not its node's leader) is alive, silent
        rows = job.wait_rows(0, 4)
        job.log(5)  # it is back
        rows = job.wait_rows(0, 5)
        job.stop()
    assert [r.values["job/ranks"] for r in rows] == [3, 3, 3, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "rank 2" in m]) == 1, warnings
    assert any("rank 2 sends rows again" in r.getMessage() for r in caplog.records)


def test_ranks_that_log_different_steps_are_told_once_as_such_and_not_waited_for(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user error: rank 1 logs every 2nd step, rank 0 every step.  Said once, as what it
    is (not a WARNING a row that its process "has exited, or it stalls"), and rank 0's rows
    of the steps rank 1 did not log are not held for the node's wait (``NODE_WAIT_S``, set
    past this test's own wait for the rows: a row held for it never comes in time)."""
    monkeypatch.setattr(levels, "NODE_WAIT_S", 10 * WAIT_S)
    job = Job(world=2, nodes=1)
    with caplog.at_level(logging.INFO, logger="gpulens"):
        for step in range(1, 9):
            job.log(step, ranks=[0, 1] if step % 2 == 0 else [0])
        job.wait_rows(0, 8)
        job.stop()
    rows = job.rows[0]
    assert [(r.step, r.values["job/ranks"]) for r in rows] == [
        (s, 2 if s % 2 == 0 else 1) for s in range(1, 9)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "rank 1" in warnings[0] and "different steps" in warnings[0], warnings


def test_a_rank_that_stopped_its_monitor_is_told_as_stopped(
        fast_waits: None, caplog: pytest.LogCaptureFixture) -> None:
    """Uneven ranks: rank 1 logs 3 steps and stops its monitor, rank 0 goes on to 6. The
    rows after it are partial, and the WARNING says the rank's monitor was stopped (its slot
    done, every entry read), not that its process "has exited, or it stalls"."""
    job = Job(world=2, nodes=1)
    with caplog.at_level(logging.INFO, logger="gpulens"):
        for step in (1, 2, 3):
            job.log(step)
        job.wait_rows(0, 3)

        def stop_rank_1(r: int) -> None:
            if r == 1:
                job.w[1].flush(WAIT_S)
                job.g[1].flush(WAIT_S)

        job._parallel(stop_rank_1)
        for step in (4, 5, 6):
            job.log(step, ranks=[0])
        rows = job.wait_rows(0, 6)
        job.stop()
    assert [r.values["job/ranks"] for r in rows] == [2, 2, 2, 1, 1, 1]
    told = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "rank 1" in r.getMessage()]
    assert len(told) == 1 and "its monitor was stopped" in told[0], told


@pytest.mark.parametrize(("tcp", "who"), [(False, 2), (True, 0)],
                         ids=["training-processes-rank-2", "engines-rank-0"])
def test_a_rank_that_cannot_open_its_node_file_trains_on_and_is_told(
        tcp: bool, who: int, fast_waits: None, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes: a rank cannot open its node's file. Its start does not fail (a monitoring
    fault never stops training); it says so once, and the job's rows go on without it, marked
    partial. Rank 0 so (the engines gathering, a TCPStore) still merges the other nodes'."""
    from gpulens.distributed import gather

    real = gather.attach_ring

    def attach(path: Path, m: Any) -> NodeRing:
        if m.rank == who:
            raise OSError("no such file")
        return real(path, m)

    monkeypatch.setattr(gather, "attach_ring", attach)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job = Job(world=4, nodes=2, tcp=tcp)
        if who == 0:
            assert job.w[0].ring is None and job.w[0].is_writer
        for step in (1, 2):
            job.log(step)
        rows = job.wait_rows(0, 2)
        job.stop()
    assert [(r.values["job/ranks"], r.values["job/partial"]) for r in rows] == [(3, 1)] * 2
    assert f"gpu/{who}/util_pct" not in rows[-1].values and "gpu/3/util_pct" in rows[-1].values
    said = [r.getMessage() for r in caplog.records if "could not join" in r.getMessage()]
    assert said == [f"gpulens: rank {who} could not join its node's gather (OSError('no such "
                    "file')); its rows are not gathered"]


def test_a_node_that_never_sends_is_told_once(fast_waits: None,
                                              caplog: pytest.LogCaptureFixture) -> None:
    job = Job(world=4, nodes=2)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        job.g[3].close()  # node 1's leader is gone
        for step in (1, 2, 3):
            job.log(step, ranks=[0, 1, 2])
        rows = job.wait_rows(0, 3)
        job.g[2].close()
        job._parallel(lambda r: job.g[r].flush(WAIT_S) if r < 2 else None)
    assert [(r.values["job/nodes"], r.values["job/partial"]) for r in rows] == [(1, 1)] * 3
    said = [r.getMessage() for r in caplog.records if "node 1 (node1)" in r.getMessage()]
    assert len(said) == 1


# -- pieces ------------------------------------------------------------------------------------
def test_node_ring_entries_and_loss(tmp_path: Path) -> None:
    ring = NodeRing.create(tmp_path / "gpulens-t-n0", slots=2, ring=4, width=3)
    other = NodeRing.attach(tmp_path / "gpulens-t-n0", slots=2, ring=4, width=3)
    other.claim(1, 7, 123)
    assert ring.read(1, 0) is None
    for seq in range(6):
        other.write(1, seq, [float(seq), 1.0, math.nan])
    assert ring.read(1, 0) == LOST and ring.read(1, 1) == LOST  # overwritten: ring of 4
    assert ring.read(1, 5)[:2] == [5.0, 1.0]
    other.finish(1, 6)
    assert ring.state(1)[1:] == (7, 123, 6, 6)
    other.close()
    ring.close()
    assert not (tmp_path / "gpulens-t-n0").exists()
    small = NodeRing.create(tmp_path / "gpulens-u-n0", 1, 1, 1)
    with pytest.raises(ValueError, match="not a gpulens node ring"):
        NodeRing.attach(tmp_path / "gpulens-u-n0", slots=2, ring=4, width=3)
    small.close()


def test_stale_node_files_of_dead_leaders_are_swept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = NodeRing.create(tmp_path / "gpulens-new-n0", 1, 1, 1)
    stale = NodeRing.create(tmp_path / "gpulens-old-n0", 1, 1, 1)
    stale._cells[5] = float(dead.pid)  # its leader is gone (killed before it could clean up)
    assert sweep_stale(tmp_path) == 1  # also run by every leader's create()
    assert not (tmp_path / "gpulens-old-n0").exists() and (tmp_path / "gpulens-new-n0").exists()
    live.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_zombie_is_not_alive() -> None:
    """An engine that died under an exited training process may stay a zombie for good (a
    container whose first process reaps nothing): its slot must not be waited for."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + WAIT_S
    while b") Z " not in Path(f"/proc/{child.pid}/stat").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not pid_alive(child.pid)
        assert pid_alive(os.getpid()) and not pid_alive(0)
    finally:
        child.wait()
    assert not pid_alive(child.pid)


class _NoQueues:
    """A store without queue operations (FileStore, a TCPStore before torch 2.8)."""

    def __init__(self) -> None:
        self._s = dist.HashStore()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("queue_"):
            raise AttributeError(name)
        return getattr(self._s, name)


@pytest.mark.parametrize("store", [dist.HashStore, _NoQueues])
def test_the_channel_with_and_without_store_queues(store: Any) -> None:
    s = store()
    up, down = UpChannel(s, "p/", nodes=2), UpChannel(s, "p/", nodes=2)
    for i in range(3):
        assert up.push(i % 2, bytes([i]))
    got = down.pop_all()
    assert sorted(got) == [b"\x00", b"\x01", b"\x02"] and down.pop_all() == []
    assert down.bytes_in == 3


def test_node_summary_round_trip_is_fixed_size() -> None:
    best = agg.BestSoFar()
    entries = {r: agg.pack_rank(4, 1.0, {f"gpu/{r}/util_pct": 10.0 * r, "perf/steps": 1.0,
                                         "perf/step_time_s": 1.0, "work/cpu_s": 0.5}, r, r)
               for r in range(3)}
    summary, _ = agg.reduce_node(0, 0, entries, 4, [3], 0, 64, best)
    raw = summary.encode(agg.featured_slots(64))
    alone, _ = agg.reduce_node(0, 0, {0: entries[0]}, 4, [1, 2, 3], 0, 64, best)
    assert len(alone.encode(agg.featured_slots(64))) == len(raw)
    back = agg.NodeSummary.decode(raw)
    assert (back.ranks, back.expected, back.missing, back.step) == (3, 4, (3,), 4)
    assert back.aggs["util_pct"].total == pytest.approx(30.0)


def test_rows_logged_in_a_burst_wake_the_gather_thread_once() -> None:
    """Rows that come while a wake-up is pending join it: one notify (one thread switch) for
    a burst, not one per row; and they all meet on rank 0 all the same."""
    job = Job(world=2, nodes=1)
    g0 = job.w[0]
    with g0._wake:  # the thread cannot start its pass until the burst is in
        wakes = g0.stats["wakes"]
        job.log(1, ranks=[0])
        for step in range(2, 41):  # fewer than the node file's ring holds
            job.log(step, ranks=[0])
        assert g0.stats["wakes"] == wakes + 1
    for step in range(1, 41):
        job.log(step, ranks=[1])
    rows = job.wait_rows(0, 40)
    job.stop()
    assert [r.step for r in rows] == list(range(1, 41))
    assert all(r.values["job/ranks"] == 2 for r in rows)
