"""The job's shape: which node each rank runs on, its local rank, its GPU.

Two parts:

* :func:`placement_from_env`: what this process learns from its launcher's environment alone
  (no network): global rank and world size, local rank, node index and node name.  Read, in
  order of precedence:

  ===========================  ===============================  =============================
  launcher                     node index                       local rank
  ===========================  ===============================  =============================
  ``GPULENS_NODE_INDEX``       itself (tests, odd launchers)    \\-
  torchrun / torchelastic,     ``GROUP_RANK``                   ``LOCAL_RANK``
  Accelerate (``accelerate
  launch`` runs torchrun)
  Lightning's launcher         ``NODE_RANK``                    ``LOCAL_RANK``
  Slurm ``srun``               ``SLURM_NODEID``                 ``SLURM_LOCALID``
  Open MPI / MPICH             \\-                              ``OMPI_COMM_WORLD_LOCAL_RANK``,
                                                                ``MPI_LOCALRANKID``
  ===========================  ===============================  =============================

  The node's name is ``GPULENS_NODE_NAME`` (two launches on one host that play two nodes),
  else ``SLURMD_NODENAME``, else the host name.  Where no variable gives the node index, the
  ranks find it in the start exchange (:mod:`gpulens.distributed.start`): nodes are told apart
  by name and numbered in name order.  The global rank and world size are always
  ``torch.distributed``'s own.

* :class:`~gpulens.model.RankInfo` and :class:`~gpulens.model.JobShape` (shared types, in
  :mod:`gpulens.model`): the result of the start exchange, every rank of the job with its node
  and GPU.  They cross to the engine in its spec and reach the sinks in the run's context (the
  JSONL ``run_start`` line, the trackers' run config).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from gpulens.model import JobShape, RankInfo

__all__ = ["JobShape", "Placement", "RankInfo", "placement_from_env", "torch_distributed_ready"]

NODE_NAME_ENV = "GPULENS_NODE_NAME"
NODE_INDEX_ENV = "GPULENS_NODE_INDEX"

_NODE_INDEX_VARS = (
    # (variable, launcher); torchelastic's own first: under ``srun torchrun`` SLURM_NODEID is
    # the agent's node, which torchrun may number differently
    ("GROUP_RANK", "torchrun"),
    ("NODE_RANK", "lightning"),
    ("SLURM_NODEID", "slurm"),
)
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "MPI_LOCALRANKID")


def torch_distributed_ready() -> bool:
    """Whether torch.distributed is initialised with more than one rank (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size() > 1)
    except Exception:
        return False


@dataclass(frozen=True)
class Placement:
    """Where this process runs, from its environment (see the module doc)."""

    rank: int
    """Global rank."""
    world: int
    """Ranks in the job."""
    local_rank: int | None
    """Rank on its node, where the launcher says; ``None``: found in the start exchange."""
    node_index: int | None
    """The node's index in the job, where the launcher says; ``None``: found by name."""
    node_name: str
    """The node's name: ``GPULENS_NODE_NAME``, ``SLURMD_NODENAME`` or the host name."""
    launcher: str
    """``"torchrun"``, ``"lightning"``, ``"slurm"``, ``"mpi"`` or ``"unknown"``."""

    @property
    def node_key(self) -> str:
        """How ranks of one node recognise each other: its index, else its name."""
        return f"i{self.node_index}" if self.node_index is not None else f"h{self.node_name}"


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def placement_from_env(rank: int, world: int, env: Mapping[str, str] | None = None
                       ) -> Placement:
    """This process's :class:`Placement`: ``rank`` and ``world`` from torch.distributed, the
    rest from ``env`` (default ``os.environ``) as the module doc says."""
    env = os.environ if env is None else env
    launcher = "unknown"
    node_index = _int(env, NODE_INDEX_ENV)
    torchelastic = "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env
    for name, who in _NODE_INDEX_VARS:
        if who == "lightning" and torchelastic:
            continue  # torchrun's GROUP_RANK is the truth there; NODE_RANK a user's argument
        value = _int(env, name)
        if value is not None:
            launcher = who
            if node_index is None:
                node_index = value
            break
    local_rank = None
    for name in _LOCAL_RANK_VARS:
        local_rank = _int(env, name)
        if local_rank is not None:
            if launcher == "unknown":
                launcher = "mpi" if name.startswith(("OMPI", "MPI")) else launcher
            break
    if launcher == "unknown" and torchelastic:
        launcher = "torchrun"
    node_name = (env.get(NODE_NAME_ENV, "").strip() or env.get("SLURMD_NODENAME", "").strip()
                 or socket.gethostname())
    return Placement(rank=rank, world=world, local_rank=local_rank, node_index=node_index,
                     node_name=node_name, launcher=launcher)
