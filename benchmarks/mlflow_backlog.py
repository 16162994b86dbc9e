"""How long ``stop()`` waits for the MLflow sink after fast steps: rows written one
``log_batch`` call each (the design before the twentieth session) against a backlog written up
to 1000 metrics a call (``MlflowSink.write_rows``), side by side in one run.

Each arm: a monitor on simulated GPUs into a fresh local SQLite store, ``--steps`` steps of
``--step-ms`` of busy CPU each, then ``stop()``; the store is read back (every step's loss
there, on its step). The engine runs in a thread of this process (``isolation="thread"``) so
that the old design can be switched on here (``writer.ROWS_PER_CALL = 1``); the arms
alternate, ``--rounds`` times.

    python benchmarks/mlflow_backlog.py [--steps 1000] [--step-ms 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path


def arm(batched: bool, steps: int, step_s: float) -> tuple[float, int]:
    import mlflow

    import gpulens
    from gpulens.sinks import writer

    writer.ROWS_PER_CALL = 100 if batched else 1
    uri = f"sqlite:///{Path(tempfile.mkdtemp()) / 'm.db'}"
    mlflow.set_tracking_uri(uri)
    mon = gpulens.Monitor(interval=0.5, sinks=["mlflow"], backend="simulated",
                          isolation="thread").start()
    for step in range(1, steps + 1):
        t = time.perf_counter()
        while time.perf_counter() - t < step_s:
            pass
        mon.log(step, loss=1.0 / step)
    t = time.perf_counter()
    mon.stop()
    waited = time.perf_counter() - t
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs(["0"])
    got = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in got) == list(range(1, steps + 1)), len(got)
    return waited, len(got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    logging.getLogger("alembic").setLevel(logging.WARNING)
    waits: dict[str, list[float]] = {"one call a row": [], "batched backlog": []}
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for batched in order:
            waited, rows = arm(batched, args.steps, args.step_ms / 1000)
            name = "batched backlog" if batched else "one call a row"
            waits[name].append(waited)
            print(f"round {r + 1}: {name}: stop() {waited:.2f} s, {rows} rows in the store")
    old, new = (statistics.median(waits[k]) for k in ("one call a row", "batched backlog"))
    print(f"\n{args.steps} steps of {args.step_ms:g} ms: stop() median {old:.2f} s one call a "
          f"row, {new:.2f} s batched: {old / new:.1f}x")


if __name__ == "__main__":
    main()
