"""What the trackers' clients cost the training process (CPU, simulated GPUs).

1. MLflow: CPU time of ``MlflowClient.log_batch`` into a local SQLite store for 1, 5 and 20
   rows of 100 metrics (is batching cheaper?).
2. Step-time stalls: a small transformer trained on the CPU for 120 steps, every step logged
   through ``gpulens.Monitor`` with 2 simulated GPUs and one sink at a time (none, jsonl,
   mlflow into SQLite, wandb offline), with the sampler in a thread of the training process
   and in a process of its own (``isolation``; JSONL and MLflow are then written there, W&B
   still here): median, p95 and worst step, and the worst ``log()``.

    .venv/bin/python benchmarks/tracker_cost.py [--steps 120]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def mlflow_row_cost(tmp: Path) -> None:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'cost.db'}")
    run_id = client.create_run("0").info.run_id
    keys = [f"gpu/{g}/k{i}" for g in range(2) for i in range(50)]
    for rows in (1, 5, 20):
        metrics = [Metric(k, 1.0, 0, s) for s in range(rows) for k in keys]
        wall, cpu = time.perf_counter(), time.thread_time()
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i:i + 1000], synchronous=True)
        print(f"MLflow log_batch, SQLite: {rows:2d} rows x 100 metrics: "
              f"{(time.perf_counter() - wall) * 1e3:6.0f} ms wall, "
              f"{(time.thread_time() - cpu) * 1e3:6.0f} ms CPU")


def stalls(tmp: Path, sink: str, steps: int, isolation: str) -> None:
    import mlflow
    import torch
    import wandb
    from torch import nn

    import gpulens

    sinks = {"none": [], "jsonl": [f"jsonl:{tmp / 's.jsonl'}"], "mlflow": ["mlflow"],
             "wandb": ["wandb"]}[sink]
    if sink == "mlflow":
        mlflow.set_tracking_uri(f"sqlite:///{tmp / 'stalls.db'}")
        mlflow.start_run()
    if sink == "wandb":
        wandb.init(project="gpulens-tracker-cost")
    torch.manual_seed(0)
    vocab, width, seq, batch = 512, 128, 64, 16
    model = nn.Sequential(
        nn.Embedding(vocab, width),
        nn.TransformerEncoder(nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, batch_first=True), num_layers=2),
        nn.Linear(width, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    perm = torch.randperm(vocab)
    step_s: list[float] = []
    log_s: list[float] = []
    with gpulens.Monitor(interval=0.1, sinks=sinks, isolation=isolation) as mon:
        for step in range(1, steps + 1):
            t = time.perf_counter()
            x = torch.randint(0, vocab, (batch, seq))
            loss = nn.functional.cross_entropy(model(x).reshape(-1, vocab), perm[x].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            t_log = time.perf_counter()
            mon.log(step, loss=loss.detach())
            log_s.append(time.perf_counter() - t_log)
            step_s.append(time.perf_counter() - t)
    if sink == "mlflow":
        mlflow.end_run()
    if sink == "wandb":
        wandb.finish()
    s = sorted(step_s)
    print(f"sink {sink:6s}, sampler in a {isolation:7s}: "
          f"step median {s[len(s) // 2] * 1e3:6.1f} ms, "
          f"p95 {s[int(len(s) * 0.95)] * 1e3:6.1f} ms, worst {s[-1] * 1e3:6.1f} ms; "
          f"worst log() {max(log_s) * 1e3:5.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.update(GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="2",
                          WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off",
                          WANDB_DIR=str(tmp), MLFLOW_DISABLE_TELEMETRY="true")
        import logging

        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        mlflow_row_cost(tmp)
        for sink in ("none", "jsonl", "mlflow", "wandb"):
            for isolation in ("thread", "process"):
                stalls(tmp, sink, args.steps, isolation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
