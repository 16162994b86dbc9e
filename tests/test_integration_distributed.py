"""Distributed jobs: ``torchrun --nproc_per_node 2`` on CPU (gloo) with simulated GPUs, one per
rank, for the plain loop, the Hugging Face Trainer and Lightning. Rank 0 alone writes; each row
holds both ranks' GPUs (keyed by global rank) and the job-level ``gpu/all/*`` aggregates, on
exactly the framework's logging steps. Every run must end by itself: no retry, and no process of
the job (rank, engine process) may outlive torchrun; a run that hangs is killed whole at the
timeout (``tests/support/torchrun.py``).

In-process tests of the gather's gloo group (a one-rank gloo world in this process): it is
gpulens's own, and ``close()`` takes it down, its worker threads joined."""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.jsonl import read_rows
from tests.support.torchrun import kill_all_jobs, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RANK_KEYS = ("gpu/0/util_pct", "gpu/1/util_pct", "gpu/all/util_pct_mean",
             "gpu/all/util_pct_min", "gpu/all/util_pct_max", "gpu/0/power_w", "gpu/1/power_w")
TORCHRUN_TIMEOUT_S = 240.0


@pytest.fixture(autouse=True)
def _no_job_left() -> Iterator[None]:
    yield
    kill_all_jobs()  # whatever a failing test left: every rank's process group


def torchrun(args: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(GPULENS_BACKEND="simulated", OMP_NUM_THREADS="1")
    done = run_torchrun(args, cwd=cwd, env=env, timeout=TORCHRUN_TIMEOUT_S)
    assert not done.timed_out, (f"torchrun hung: killed after {TORCHRUN_TIMEOUT_S:.0f} s",
                                done.stdout[-2000:], done.stderr[-6000:])
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
    assert not done.leftovers, f"processes of the job outlived torchrun: {done.leftovers}"


def jsonl(path: Path) -> list[dict[str, Any]]:
    return read_rows(path)


def check_rows(rows: list[dict[str, Any]], steps: list[int]) -> None:
    assert [r["step"] for r in rows] == steps  # one row per log: only rank 0 wrote
    for row in rows:
        for key in RANK_KEYS:
            assert key in row, key
        assert not any(k.startswith("gpu/2/") for k in row)
        assert row["gpu/all/util_pct_min"] <= row["gpu/all/util_pct_mean"] \
            <= row["gpu/all/util_pct_max"]


def test_plain_loop_ddp(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    torchrun([str(EXAMPLES / "plain_loop.py"), "--out", str(out), "--steps", "30",
              "--log-every", "10"], tmp_path)
    rows = jsonl(out)
    check_rows(rows, [10, 20, 30])
    assert all("train/loss" in r and "perf/data_wait_pct" in r for r in rows)


def test_hf_trainer_ddp(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torchrun([str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(tmp_path / "out"),
              "--max-steps", "12", "--logging-steps", "4"], tmp_path)
    rows = jsonl(tmp_path / "out" / "gpulens.jsonl")
    check_rows(rows, [4, 8, 12])
    assert all("train/loss" in r for r in rows)


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_ddp(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package)
    sink = tmp_path / "rows.jsonl"
    torchrun([str(EXAMPLES / "lightning_fit.py"), "--package", package, "--save-dir",
              str(tmp_path), "--max-steps", "12", "--log-every", "4", "--sink",
              f"jsonl:{sink}"], tmp_path)
    check_rows(jsonl(sink), [3, 7, 11])
    (metrics,) = tmp_path.rglob("metrics.csv")  # one logger file: rank 0's
    with open(metrics) as f:
        logged = list(csv.DictReader(f))
    loss_steps = sorted({int(r["step"]) for r in logged if r["train_loss"]})
    gpu_steps = sorted({int(r["step"]) for r in logged if r.get("gpu/1/util_pct")})
    assert loss_steps == gpu_steps == [3, 7, 11]


RAISING_RANK = """
import sys, time
import torch, torch.distributed as dist
from torch import nn
import gpulens

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{sys.argv[1]}"]) as mon:
    for step in range(1, 40):
        if rank == 1 and step == 5:
            raise RuntimeError("rank 1 fails at step 5")
        model(torch.randn(4, 8)).sum().backward()  # rank 0 then waits in DDP's all-reduce
        mon.log(step, tokens=32)
        time.sleep(0.02)
"""


def test_a_rank_that_raises_ends_the_job_and_gpulens_does_not_hold_it(tmp_path: Path) -> None:
    """An exception leaves rank 1's ``with Monitor``: its stop() must not wait in gpulens's
    gather for rank 0 (stuck in DDP's all-reduce, and torchrun then ends it); the job ends in
    seconds, not at gloo's 30-minute time-out."""
    script = tmp_path / "raising.py"
    script.write_text(RAISING_RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(GPULENS_BACKEND="simulated", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src"))
    done = run_torchrun([str(script), str(tmp_path / "rows.jsonl")], cwd=tmp_path, env=env,
                        timeout=90.0)
    assert not done.timed_out, done.stderr[-4000:]
    assert done.returncode != 0 and "rank 1 fails at step 5" in done.stderr
    assert not done.leftovers


def test_ddp_rows_carry_the_jobs_work_and_each_ranks_cpu_time(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    torchrun([str(EXAMPLES / "plain_loop.py"), "--out", str(out), "--steps", "20",
              "--log-every", "5", "--tokens-per-step", "100"], tmp_path)
    rows = jsonl(out)
    for row in rows:  # both ranks' tokens: 2 ranks x 100 tokens x 5 steps a window
        window = row["perf/step_time_s"] * row["perf/steps"]
        assert row["perf/tokens_per_s"] * window == pytest.approx(1000.0)
        assert row["rank/0/cpu_busy_s"] > 0 and row["rank/1/cpu_busy_s"] > 0
        assert not any(k.startswith("work/") for k in row)


LATE_RANK = """
import json, sys, threading, time
import torch.distributed as dist
import gpulens

dist.init_process_group("gloo")
rank = dist.get_rank()
gathers = []
real = dist.all_gather
def spy(*args, **kwargs):  # which thread runs gpulens's all-gathers (its group's only)
    gathers.append(threading.current_thread().name)
    return real(*args, **kwargs)
dist.all_gather = spy
waits = []
with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{sys.argv[1]}"]) as mon:
    for step in range(1, 7):
        if rank == 1 and step == 3:
            time.sleep(1.5)  # rank 1 comes late to step 3's log()
        t0 = time.perf_counter()
        mon.log(step, loss=1.0 / step)
        waits.append(time.perf_counter() - t0)
        time.sleep(0.02)
dist.barrier()
# one file per rank: the ranks' stdout lines interleave in torchrun's stream
with open(f"{sys.argv[2]}.{rank}", "w") as f:
    json.dump({"rank": rank, "waits": waits, "gathers": gathers}, f)
dist.destroy_process_group()
"""


def test_log_never_waits_for_another_rank(tmp_path: Path) -> None:
    """``log()`` is a collective, but the exchange of rows runs in gpulens's gather thread:
    a rank that reaches ``log()`` while another is 1.5 s late goes on at once, and every row
    still holds both ranks' GPUs."""
    import json

    script = tmp_path / "late.py"
    script.write_text(LATE_RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(GPULENS_BACKEND="simulated", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src"))
    out = tmp_path / "rows.jsonl"
    result = tmp_path / "result"
    done = run_torchrun([str(script), str(out), str(result)], cwd=tmp_path, env=env,
                        timeout=TORCHRUN_TIMEOUT_S)
    assert not done.timed_out and done.returncode == 0, done.stderr[-4000:]
    results = {rank: json.loads((tmp_path / f"result.{rank}").read_text()) for rank in (0, 1)}
    # rank 0's log() at step 3 and after: no wait for rank 1 (it would be ~1.5 s inside log())
    assert max(results[0]["waits"]) < 0.5, results[0]["waits"]
    for r in results.values():
        assert r["gathers"] and set(r["gathers"]) == {"gpulens-gather"}, r["gathers"]
    check_rows(jsonl(out), [1, 2, 3, 4, 5, 6])


# -- the gather's own gloo group, in this process ----------------------------------------------
def _threads() -> set[int]:
    """The native threads of this process (gloo's worker threads are not Python threads)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _wait_gone(tids: set[int], timeout: float = 5.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while tids & _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return tids & _threads()


@pytest.fixture
def gloo_world() -> Iterator[Any]:
    """A one-rank gloo world in this process; destroyed afterwards if still up."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _gather(rows: list[Any]) -> Any:
    from gpulens.distributed import RankGather
    from gpulens.model import GpuInfo, RunContext

    context = RunContext(gpus=(GpuInfo(index=0, name="sim", uuid="GPU-0", pci_bus_id="0"),),
                         hostname="h", backend="simulated", interval=0.1)
    return RankGather(context, submit=rows.append)


def _row(step: int) -> Any:
    from gpulens.model import Row

    return Row(step=step, time=float(step), values={"gpu/0/util_pct": 50.0 + step,
                                                    "train/loss": 1.0 / step})


def test_gather_runs_on_a_group_of_its_own_and_close_joins_its_threads(gloo_world: Any) -> None:
    dist = gloo_world
    from torch.distributed import distributed_c10d

    before = _threads()
    rows: list[Any] = []
    gather = _gather(rows)
    # its own group even though training uses gloo: its works never sit in the training's group
    own = _threads() - before
    assert own, "the gather made no gloo group (and so no threads) of its own"
    assert len(distributed_c10d._world.pg_map) == 2
    gather.local_row(_row(1))
    gather.local_row(_row(2))
    gather.exchange()
    gather.local_row(_row(3))
    gather.flush()  # the last exchanges, then close()
    assert [r.step for r in rows] == [1, 2, 3]
    assert rows[2].values["gpu/0/util_pct"] == 53.0 and "train/loss" in rows[2].values
    assert gather.closed
    # released in close(), not whenever the gather is garbage-collected: threads joined (the
    # destructor's join returns only once they have ended), group unregistered
    assert not _wait_gone(own)
    assert list(distributed_c10d._world.pg_map) == [distributed_c10d._get_default_group()]
    assert gather.exchange() == 0  # after close: nothing, and never on the default group
    gather.close()  # idempotent
    assert dist.is_initialized()


def test_close_after_the_default_group_was_destroyed(gloo_world: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    dist = gloo_world
    before = _threads()
    gather = _gather([])
    own = _threads() - before
    assert own
    dist.destroy_process_group()  # the user's teardown came first: it unregistered ours too
    assert own & _threads()  # the gather still holds its group
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        gather.close()
    assert not caplog.records
    assert not _wait_gone(own)


def test_rows_after_the_last_exchange_are_told(gloo_world: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from gpulens.log import reset_warnings

    reset_warnings()
    rows: list[Any] = []
    gather = _gather(rows)
    gather.local_row(_row(1))
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        gather.close()  # without the last exchanges (stop() failed half-way): row 1 is lost
        gather.local_row(_row(2))  # and row 2 came too late
    assert gather.late_rows == 2 and rows == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("1 row(s) of rank 0 came after the last exchange" in m for m in messages)
    assert any("a row of rank 0 came after the ranks' last exchange" in m for m in messages)


def test_a_failed_exchange_is_told_and_never_reaches_training(
        gloo_world: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gather thread's all-gather fails (a rank gone, the group torn down): one WARNING
    through the ``gpulens`` logger in this (the training) process, ``request()`` keeps
    returning, and ``flush()`` still releases the group."""
    from gpulens.log import reset_warnings

    reset_warnings()
    rows: list[Any] = []
    gather = _gather(rows)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(gather._dist, "all_gather", broken)
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        gather.local_row(_row(1))
        gather.request()
        deadline = time.monotonic() + 5
        while not any("exchange of rows" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no warning for the failed exchange"
            time.sleep(0.01)
        t0 = time.perf_counter()
        gather.request()  # after the failure: counted nowhere, never waits
        assert time.perf_counter() - t0 < 0.05
        gather.flush(5.0)
    failed = [r for r in caplog.records if "exchange of rows" in r.getMessage()]
    assert len(failed) == 1 and "Connection closed by peer" in failed[0].getMessage()
    assert rows == [] and gather.closed
