"""What a distributed job's start says and refuses (review 21c): a rank naming several GPUs,
a rank whose peers never start a monitor, ranks that share one GPU."""

from __future__ import annotations

import logging
import time

import pytest

dist = pytest.importorskip("torch.distributed")

import gpulens  # noqa: E402
from gpulens.distributed import start  # noqa: E402
from gpulens.distributed.topology import Placement  # noqa: E402
from gpulens.model import GpuInfo, JobShape, RankInfo  # noqa: E402


def test_a_rank_that_names_several_gpus_is_refused_before_the_start_exchange(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``gpus=[0, 1]`` on every rank of a DDP job: a rank's row carries one GPU keyed by its
    global rank, so GPU 1 was dropped without a word and both ranks' GPU 0 went under
    ``gpu/0`` (rows with one GPU key, ``job/gpus`` 2). Now a one-line ``ValueError`` on every
    rank, before the exchange (no rank waits for another that raised)."""
    import gpulens.distributed as distributed

    monkeypatch.setattr(distributed, "torch_distributed_ready", lambda: True)
    mon = gpulens.Monitor(gpus=[0, 1], backend="simulated", sinks=[], isolation="thread")
    with pytest.raises(ValueError, match=r"gpus=\[0, 1\]: in a distributed job each rank "
                                         r"watches one GPU"):
        mon.start()
    from gpulens.distributed.gather import check_rank_gpus

    check_rank_gpus(None)
    check_rank_gpus([1])


def test_a_rank_left_waiting_at_start_says_so_early(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A monitor made on rank 0 alone (``if rank == 0: Monitor(...)``) held rank 0's
    ``start()`` for START_TIMEOUT_S (120 s) and said nothing until then. It now says after
    START_NOTE_S who has come and that every rank must start one, then waits on."""
    monkeypatch.setattr(start, "START_NOTE_S", 0.2, raising=False)
    place = Placement(rank=0, world=2, local_rank=0, node_index=0, node_name="vm",
                      launcher="torchrun")
    began = time.time()
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        m = start.join(dist.HashStore(), place, 1, timeout=1.5)
    said = [(r.created - began, r.getMessage()) for r in caplog.records]
    assert m.arrived == 1
    early = [(t, s) for t, s in said if "has waited" in s]
    assert len(early) == 1, said
    assert "(1 of 2 have)" in early[0][1] and "every rank must start one" in early[0][1]
    final = [i for i, (_, s) in enumerate(said) if "waited 2 s at start" in s]
    assert final and said.index(early[0]) < final[0], said  # said before the wait ends


def test_a_quick_exchange_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    place = Placement(rank=0, world=1, local_rank=0, node_index=0, node_name="vm",
                      launcher="torchrun")
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        start.join(dist.HashStore(), place, 1, timeout=1.0)
    assert not caplog.records


def _gpu(uuid: str, index: int) -> GpuInfo:
    return GpuInfo(index=index, name="H100", uuid=uuid, pci_bus_id="0")


def test_ranks_that_watch_one_gpu_are_said(caplog: pytest.LogCaptureFixture) -> None:
    """``gpus=[0]`` on every rank, or 3 ranks on 2 GPUs: one GPU's figures under two ranks,
    its power and energy counted twice in the job's sums, with no word before."""
    from gpulens.engine.engine import _say_shared_gpus

    ranks = (RankInfo(0, 0, 0, "a", (_gpu("GPU-0", 0),)),
             RankInfo(1, 1, 0, "a", (_gpu("GPU-1", 1),)),
             RankInfo(2, 2, 0, "a", (_gpu("GPU-0", 2),)),
             RankInfo(3, 0, 1, "b", (_gpu("GPU-0", 3),)))  # another node: not the same GPU
    job = JobShape(world=4, nodes=2, launcher="torchrun", ranks=ranks)
    assert job.shared_gpus() == [(0, 2)]
    with caplog.at_level(logging.WARNING, logger="gpulens"):
        _say_shared_gpus(job)  # what rank 0's engine says once its job view is built
    (said,) = [r.getMessage() for r in caplog.records]
    assert "ranks 0, 2 watch one GPU" in said and "2 times" in said
    alone = JobShape(world=2, nodes=1, launcher="torchrun", ranks=ranks[:2])
    assert alone.shared_gpus() == []
    assert JobShape(world=4, nodes=2, launcher="torchrun", ranks=ranks,
                    view="node").shared_gpus() == []
