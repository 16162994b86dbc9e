"""The start exchange, through the job's own ``torch.distributed`` store (the launcher's
TCPStore: no connection of gpulens's own, no collective).

Every rank, at ``Monitor.start()`` (keys under ``gpulens/<restart>/<generation>/``)::

    rank 0 only   set    token                      a random id: the node files' names
    every rank    append node/<key>/members  "r,"  its node's members (key: index or name)
                  add    node/<key>/n  1           the first of a node appends to "nodes"
                  add    arrived  1                 the last one in sets "all"
                  wait   all                        (bounded: START_TIMEOUT_S)
                  get    token, node/<key>/members, nodes

so each rank learns its node's members (global ranks), the node's leader
(:attr:`Membership.leader`: rank 0 in a job of one node, else the node's second rank), its
slot on the node and the number of nodes: O(1) store operations per rank, O(ranks
of its node + nodes) bytes.

Then each rank's GPU, once its engine has opened it (``id/<rank>``): each leader reads its
node's (``multi_get`` of its members' keys) and writes the node's list (``nodeinfo/<node>``);
rank 0 reads the nodes' lists.  That is the one time rank 0 holds a line for every GPU of the
job: for the run's metadata (the JSONL ``run_start``, the trackers' config), never per step.
Every wait is bounded; what did not come in time is left out and said.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from gpulens.distributed.topology import JobShape, Placement, RankInfo
from gpulens.log import logger
from gpulens.model import GpuInfo
from gpulens.schema import full_gpus

START_TIMEOUT_S = 120.0
"""How long a rank waits at ``start()`` for the others to join the exchange."""
START_NOTE_S = 10.0
"""A rank that has waited this long at ``start()`` for the others says so once (who is
missing, and that every rank must start a monitor), then waits on up to
:data:`START_TIMEOUT_S`: a monitor made on rank 0 alone stalled its training 120 s in
silence."""

_generation = 0
_gen_lock = threading.Lock()


def next_generation() -> int:
    """A count of the gathers this process made: the same on every rank, since every rank
    starts its monitor together."""
    global _generation
    with _gen_lock:
        _generation += 1
        return _generation


def default_store(dist: Any) -> Any:
    """The store ``init_process_group`` made (the launcher's): every rank already holds a
    connection to it."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


@dataclass(frozen=True)
class Membership:
    """What the start exchange told this rank (module doc)."""

    prefix: str
    """Store keys of this gather start with it."""
    token: str
    """Random, the same on every rank of this gather."""
    rank: int
    world: int
    node: int
    node_name: str
    members: tuple[int, ...]
    """Global ranks of this node, ascending."""
    node_keys: tuple[str, ...]
    """Every node's key, by node index."""
    local_rank: int
    launcher: str
    arrived: int
    """Ranks that joined before the exchange's wait ended (``world`` unless some were late)."""

    @property
    def leader(self) -> int:
        """The node's leader.  In a job of one node (of no more than
        :func:`~gpulens.schema.full_gpus` ranks), rank 0: the ranks' engines do the gather's
        per-row work (:mod:`gpulens.distributed.rows`), rank 0's writes the job's rows anyway,
        the node's row is the job's and no summary crosses the store.  Otherwise the node's
        second-lowest rank where it has two or more (so that rank 0, whose training process
        merges the nodes, never also reduces a node of several ranks), else its one rank.
        Every rank computes the same (``full_gpus()`` reads the job's environment, which a
        launcher gives every rank alike).

        (Before the engines gathered, rank 0 led a one-node job of two ranks only: in the
        training process, leading 4 or 8 made rank 0 the busiest rank by 23-39 % on a CPU,
        ``benchmarks/results/2026-11-27-cpu-one-node-leader``.)"""
        if len(self.node_keys) == 1 and len(self.members) <= full_gpus():
            return self.members[0]
        return self.members[1] if len(self.members) > 1 else self.members[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def slot(self) -> int:
        """This rank's slot in the node's shared file."""
        return self.members.index(self.rank)

    @property
    def nodes(self) -> int:
        return len(self.node_keys)


def _wait(store: Any, keys: list[str], timeout: float) -> list[str]:
    """Wait up to ``timeout`` s for ``keys``; the keys still missing then."""
    if not keys:
        return []
    try:
        store.wait(keys, timedelta(seconds=max(0.001, timeout)))
        return []
    except Exception:  # timed out (DistStoreError; RuntimeError in older torch)
        return [k for k in keys if not store.check([k])]


def join(store: Any, place: Placement, generation: int,
         timeout: float = START_TIMEOUT_S) -> Membership:
    """Every rank's part of the membership exchange (module doc)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    p = f"gpulens/{restart}/{generation}/"
    if place.rank == 0:
        store.set(p + "token", secrets.token_hex(6))
    key = place.node_key
    store.append(p + f"node/{key}/members", f"{place.rank},")
    if store.add(p + f"node/{key}/n", 1) == 1:
        store.append(p + "nodes", key + "\n")
    if store.add(p + "arrived", 1) >= place.world:
        store.set(p + "all", "1")
    missing = _wait(store, [p + "all", p + "token"], min(START_NOTE_S, timeout))
    if missing and timeout > START_NOTE_S:
        logger.warning("gpulens: rank %d has waited %.0f s at start for the other ranks to "
                       "start their monitors (%d of %d have); every rank must start one (a "
                       "Monitor made on some ranks only waits here up to %.0f s, then goes "
                       "on without the others)", place.rank, START_NOTE_S,
                       int(store.add(p + "arrived", 0)), place.world, timeout)
        missing = _wait(store, missing, timeout - START_NOTE_S)
    if missing:
        logger.warning("gpulens: rank %d waited %.0f s at start for the other ranks to start "
                       "their monitors; going on with those that came (the rows of the others "
                       "are not gathered)", place.rank, timeout)
    arrived = int(store.add(p + "arrived", 0))
    token = (store.get(p + "token").decode() if store.check([p + "token"])
             else f"r{restart}g{generation}")
    members = sorted({int(x) for x in store.get(p + f"node/{key}/members").decode().split(",")
                      if x})
    keys = [k for k in store.get(p + "nodes").decode().split("\n") if k]
    if all(k.startswith("i") for k in keys):
        node_keys = tuple(sorted(keys, key=lambda k: int(k[1:])))
    else:  # nodes known by name: numbered in name order
        node_keys = tuple(sorted(keys))
    node = node_keys.index(key) if place.node_index is None else place.node_index
    local = place.local_rank if place.local_rank is not None else members.index(place.rank)
    return Membership(prefix=p, token=token, rank=place.rank, world=place.world, node=node,
                      node_name=place.node_name, members=tuple(members), node_keys=node_keys,
                      local_rank=local, launcher=place.launcher, arrived=arrived)


# -- identities ----------------------------------------------------------------------------------
def _encode(infos: list[RankInfo]) -> bytes:
    return json.dumps([{**asdict(r), "gpus": [asdict(g) for g in r.gpus]}
                       for r in infos]).encode()


def _decode(raw: bytes) -> list[RankInfo]:
    out = []
    for d in json.loads(raw.decode()):
        gpus = tuple(GpuInfo(**g) for g in d.pop("gpus"))
        out.append(RankInfo(**d, gpus=gpus))
    return out


def own_info(m: Membership, gpus: tuple[GpuInfo, ...] = ()) -> RankInfo:
    return RankInfo(rank=m.rank, local_rank=m.local_rank, node=m.node, node_name=m.node_name,
                    gpus=gpus)


def publish_rank(store: Any, m: Membership, gpus: tuple[GpuInfo, ...]) -> None:
    """This rank's GPUs, for its leader."""
    store.set(m.prefix + f"id/{m.rank}", _encode([own_info(m, gpus)]))


def node_shape(store: Any, m: Membership, deadline: float) -> JobShape:
    """A leader's view of its node (before its own engine starts: its own GPUs are filled in
    by the engine): the other members' identities, waited for until ``deadline``
    (``time.monotonic()``).  Rank 0's is not waited for (it starts its engine only once it has
    every node's list): rank 0 fills in its own."""
    others = [r for r in m.members if r not in (m.rank, 0)]
    keys = [m.prefix + f"id/{r}" for r in others]
    missing = _wait(store, keys, deadline - time.monotonic())
    have = [k for k in keys if k not in missing]
    infos = [own_info(m)]
    if 0 in m.members and m.rank != 0:
        infos.append(RankInfo(rank=0, local_rank=0, node=m.node, node_name=m.node_name))
    for raw in store.multi_get(have) if have else []:
        infos.extend(_decode(raw))
    lost = tuple(int(k.rsplit("/", 1)[1]) for k in missing)
    if lost:
        logger.warning("gpulens: rank(s) %s of node %d (%s) did not say which GPU they use "
                       "within the start exchange; the run's metadata leaves them out",
                       ", ".join(map(str, lost)), m.node, m.node_name)
    return JobShape(world=m.world, nodes=m.nodes, launcher=m.launcher,
                    ranks=tuple(sorted(infos, key=lambda r: r.rank)), view="node",
                    missing=lost)


def publish_node(store: Any, m: Membership, shape: JobShape) -> None:
    """A leader's node list, for rank 0."""
    store.set(m.prefix + f"nodeinfo/{m.node}", _encode(list(shape.ranks)))


def job_shape(store: Any, m: Membership, own: JobShape | None, deadline: float) -> JobShape:
    """Rank 0's view: every node's list (its own node's is ``own`` where rank 0 leads it),
    waited for until ``deadline``."""
    keys = [m.prefix + f"nodeinfo/{n}" for n in range(m.nodes)
            if own is None or n != m.node]
    missing = _wait(store, keys, deadline - time.monotonic())
    have = [k for k in keys if k not in missing]
    infos = list(own.ranks) if own is not None else []
    for raw in store.multi_get(have) if have else []:
        infos.extend(_decode(raw))
    if missing:
        logger.warning("gpulens: node(s) %s sent no list of their GPUs within the start "
                       "exchange; the run's metadata leaves them out",
                       ", ".join(k.rsplit("/", 1)[1] for k in missing))
    seen = {r.rank for r in infos}
    lost = tuple(r for r in range(m.world) if r not in seen)
    return JobShape(world=m.world, nodes=m.nodes, launcher=m.launcher,
                    ranks=tuple(sorted(infos, key=lambda r: r.rank)), view="job",
                    missing=lost)
