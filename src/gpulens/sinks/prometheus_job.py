"""The Prometheus series of a distributed job, beside the per-GPU ones of
:mod:`gpulens.sinks.prometheus` (which carry ``node`` and ``rank`` labels there).

Each node's leader serves its node's GPUs; rank 0 serves node 0's and the job's figures.  A
fleet's Prometheus scrapes every node and aggregates with PromQL (``avg by (node)
(gpulens_gpu_sm_active_percent)``); these series add what PromQL cannot rebuild from the GPU
series:

==============================================  =================================================
``gpulens_job_ranks``                           ranks whose rows rank 0's latest row holds
``gpulens_job_nodes``                           nodes that row holds
``gpulens_job_world_ranks``                     ranks in the job
``gpulens_job_partial``                         1 while that row lacks a rank or a node, else 0
``gpulens_node_ranks{node}``                    ranks whose rows the node's latest row holds
``gpulens_node_partial{node}``                  1 while that row lacks a rank of the node
``gpulens_rank_busy_seconds{rank,basis}``       busy time per step: ``basis="gpu"`` (SM activity,
                                                else utilization, x step time) or ``"cpu"`` (the
                                                training thread's CPU seconds)
``gpulens_rank_relative_score_ratio``           the best rank's busy time / this rank's (of the
``{rank,basis}``                                node on a node's endpoint, of the job on rank 0's)
``gpulens_rank_individual_score_ratio``         this rank's best busy time so far / its current
``{rank,basis}``
==============================================  =================================================

Every series also has the ``host`` label.  Like the engine's other figures they are the latest
row's: one a row no longer carries is gone from the next scrape.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

_JOB = {
    "job/ranks": ("gpulens_job_ranks", "ranks whose rows the latest job row holds"),
    "job/nodes": ("gpulens_job_nodes", "nodes whose figures the latest job row holds"),
    "job/world": ("gpulens_job_world_ranks", "ranks in the job"),
    "job/partial": ("gpulens_job_partial", "1 while the latest job row lacks a rank or a node"),
}
_NODE = re.compile(r"^node/(\d+)/(ranks|partial)$")
_RANK = re.compile(r"^rank/(\d+)/(gpu|cpu)_(busy_s|relative_score|individual_score)$")
_RANK_SERIES = {
    "busy_s": ("gpulens_rank_busy_seconds",
               "busy time per step in the latest window (basis: gpu, cpu)"),
    "relative_score": ("gpulens_rank_relative_score_ratio",
                       "the best rank's busy time over this rank's (1: the pace of the best)"),
    "individual_score": ("gpulens_rank_individual_score_ratio",
                         "this rank's best busy time so far over its current one"),
}


def job_families(scalars: Mapping[str, float], host: str) -> Iterator[Any]:
    """The families above from the latest row's ``job/*``, ``node/*`` and ``rank/*`` keys."""
    from prometheus_client.core import GaugeMetricFamily

    for key, (name, text) in _JOB.items():
        if key in scalars:
            fam = GaugeMetricFamily(name, text, labels=["host"])
            fam.add_metric([host], scalars[key])
            yield fam
    nodes = {
        "ranks": GaugeMetricFamily("gpulens_node_ranks", "ranks whose rows the node's latest "
                                   "row holds", labels=["host", "node"]),
        "partial": GaugeMetricFamily("gpulens_node_partial", "1 while the node's latest row "
                                     "lacks one of its ranks", labels=["host", "node"]),
    }
    ranks = {k: GaugeMetricFamily(name, text, labels=["host", "rank", "basis"])
             for k, (name, text) in _RANK_SERIES.items()}
    for key, value in sorted(scalars.items()):
        if key.startswith("node/"):
            m = _NODE.match(key)
            if m is not None:
                nodes[m.group(2)].add_metric([host, m.group(1)], value)
        elif key.startswith("rank/"):
            r = _RANK.match(key)
            if r is not None:
                ranks[r.group(3)].add_metric([host, r.group(1), r.group(2)], value)
    for fam in (*nodes.values(), *ranks.values()):
        if fam.samples:
            yield fam
