"""Distributed jobs: each rank samples the GPU it trains on; rows meet in two levels.

::

    rank ──entry──> node's shared file ──> node leader ──node summary──> rank 0
    (any rank)       (/dev/shm, no socket)  (node row: its    (the launcher's store,  (job row:
                                             JSONL, Prometheus) one queue)            every sink)

* **Topology** (:mod:`.topology`, :mod:`.start`): at ``Monitor.start()`` every rank reads its
  launcher's environment (torchrun, Slurm, Lightning, Accelerate, MPI) and joins a short
  exchange through the job's own ``torch.distributed`` store: it learns its node's members and
  leader (:attr:`.start.Membership.leader`: rank 0 in a job of one node, else the node's
  second rank); leaders collect their node's GPUs, rank 0 every node's, for
  the run's metadata (:class:`.topology.JobShape` in the JSONL ``run_start`` and the trackers'
  config).
* **Node level** (:mod:`.nodering`): each rank writes each raw row, as a fixed-size entry, into
  its slot of a file in ``/dev/shm`` shared by the node; the leader reads them.  No
  collective, so a rank that dies or stalls holds nobody up.
* **Job level** (:mod:`.channel`): each leader reduces its node's entries of a row into a
  fixed-size node summary (:mod:`.aggregate`: mean, min, max, sums of power and energy, the
  least active GPUs, the busiest ranks) and pushes it onto one store queue; rank 0 pops them.
  Rank 0 receives O(nodes) bytes a row; no rank opens a connection to another rank (the
  leaders' and rank 0's engines open their own to the launcher's store), and no rank ever
  holds every GPU's row.
* **Where the per-row work runs** (:mod:`.rows`): in the ranks' engines: each engine writes
  its own entries; in a job of one node rank 0's reduces and merges them and finishes the
  job's row; in a job of several nodes the leaders' engines push their nodes' summaries and
  rank 0's merges them, each engine connecting to the job's store itself (a ``TCPStore``,
  what the launchers' ``env://`` makes).  The training processes do nothing per row for the
  gather (no row comes back to them, no thread of it shares their interpreter).  Only with a
  store another process cannot open (a ``FileStore``, a ``HashStore``) does a job of several
  nodes gather in the training processes: one thread on each leader and on rank 0
  (``gpulens-gather``), a non-leader rank writing its entries from the thread that brings rows
  back from its engine.  ``log()`` does nothing for the gather: rows wake the thread, once a
  batch (at most one pass per :data:`~.rows.PASS_S`), whatever the logging rate.

:class:`~.gather.JobGather` is the piece ``Monitor`` makes; how it survives faults (a rank or
node that dies, stalls or comes late) is in :mod:`.gather`.
"""

from __future__ import annotations

from gpulens.distributed.topology import (
    JobShape,
    Placement,
    RankInfo,
    placement_from_env,
    torch_distributed_ready,
)

__all__ = ["JobShape", "Placement", "RankInfo", "placement_from_env",
           "torch_distributed_ready"]
