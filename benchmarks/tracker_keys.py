"""How many distinct keys a tracker receives at each job size (issue 17): the budget.

    python benchmarks/tracker_keys.py --sizes 1,8,16,64,512,4096 --gpus-per-node 8

For each size it builds the rows rank 0 would write through the real code: every GPU's entry
(every key of the schema, values varied per GPU and per row), each node's reduction
(:func:`gpulens.distributed.aggregate.reduce_node`), the job's merge
(:func:`~gpulens.distributed.aggregate.merge_job`), rank 0's own keys (the ``perf/*`` keys of
the finisher and the phases, ``train/*``, ``host/*``, an ``alerts/*`` key per rule), then runs
``--rows`` rows through :class:`gpulens.sinks.layout.TrackerLayout` and counts the distinct
keys over the run (the worst-GPU slots name different GPUs row after row; their keys do not
change):

* W&B: the keys shown plus the detail it logs hidden (both count toward W&B's limits);
* MLflow: the keys shown (``keys="default"``; MLflow drops the detail);
* ``keys="all"``: every key within the budget;
* JSONL row: rank 0's row as written (for scale: keys and bytes a row).

A job of one GPU is the single-process case (no gather).  Prints a Markdown table; ``--json``
writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

from gpulens.distributed import aggregate as agg
from gpulens.engine.rules import RULES
from gpulens.schema import GPU_ROW_KEYS, gpu_key
from gpulens.sinks.layout import TrackerLayout
from gpulens.work.mfu import PERF_KEYS

BASE_PERF = ("perf/steps", "perf/step_time_s", "perf/partial_gpus", "perf/energy_per_step_j",
             "perf/data_wait_pct", "perf/data_wait_s", "perf/forward_backward_pct",
             "perf/forward_backward_s", "perf/optimizer_pct", "perf/optimizer_s", *PERF_KEYS)
TRAIN = ("train/loss", "train/learning_rate", "train/grad_norm", "train/global_step")


def gpu_values(gpu: int, rng: random.Random) -> dict[str, float]:
    """Every schema suffix of one GPU, as ``gpu/{gpu}/<suffix>``."""
    return {gpu_key(gpu, s): rng.uniform(1.0, 99.0) for s in GPU_ROW_KEYS}


def base_values(step: int, rng: random.Random) -> dict[str, float]:
    out = {k: rng.uniform(0.1, 10.0) for k in (*BASE_PERF, *TRAIN[:3])}
    out["perf/steps"] = 1.0
    out["train/global_step"] = float(step)
    out["host/cpu_pct"] = 40.0
    out["host/ram_used_gb"] = 100.0
    out.update({f"alerts/{name}": 0.0 for name in RULES})
    return out


def job_row(world: int, per_node: int, step: int, rng: random.Random,
            best: agg.BestSoFar) -> dict[str, float]:
    """Rank 0's row of one step of a job of ``world`` ranks, ``per_node`` to a node."""
    values = base_values(step, rng)
    if world == 1:
        values.update(gpu_values(0, rng))
        return values
    nodes = math.ceil(world / per_node)
    summaries = []
    for node in range(nodes):
        ranks = range(node * per_node, min(world, (node + 1) * per_node))
        entries = {}
        for r in ranks:
            raw = {**values, **gpu_values(r, rng), "work/cpu_s": rng.uniform(0.5, 1.0)}
            entries[r] = agg.pack_rank(step, 0.0, raw, r, r, node)
        summary, node_out = agg.reduce_node(node, 0, entries, len(ranks), (), 0, world, best)
        summaries.append(agg.NodeSummary.decode(summary.encode(agg.featured_slots(world))))
        if node == 0:
            values.update({k: v for k, v in node_out.items() if not k.startswith("rank/")})
    values.update(agg.merge_job(summaries, world, nodes))
    return values


def count(world: int, per_node: int, rows: int) -> dict[str, Any]:
    rng = random.Random(world)
    best = agg.BestSoFar()
    wandb, mlflow, everything, row_keys = set(), set(), set(), set()
    default, full = TrackerLayout("default"), TrackerLayout("all")
    size = 0
    for step in range(1, rows + 1):
        values = job_row(world, per_node, step, rng, best)
        shown, detail = default.split(values)
        wandb |= set(shown) | set(detail)
        mlflow |= set(shown)
        everything |= set(full.split(values)[0])
        row_keys |= set(values)
        size = len(json.dumps(values))
    return {"gpus": world, "nodes": math.ceil(world / per_node), "wandb": len(wandb),
            "mlflow": len(mlflow), "all": len(everything), "jsonl_keys": len(row_keys),
            "jsonl_bytes_per_row": size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", default="1,8,16,64,512,4096")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    results = [count(int(s), args.gpus_per_node, args.rows) for s in args.sizes.split(",")]
    lines = ["| GPUs | nodes | W&B (shown + hidden) | MLflow (default) | keys=all | "
             "rank 0 JSONL keys | rank 0 JSONL bytes/row |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['gpus']} | {r['nodes']} | {r['wandb']} | {r['mlflow']} | "
                     f"{r['all']} | {r['jsonl_keys']} | {r['jsonl_bytes_per_row']} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
