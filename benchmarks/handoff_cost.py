"""What verl's ``RowHandoff.write`` costs the training thread per row, by GPUs in the row.

``RowHandoff`` is a sink written on the training thread (inside ``Monitor.log``): since the
twenty-third session it keeps the trackers' view of each row (``TrackerLayout.split``) where it
kept every key but ``train/*`` (a dict comprehension). This times both on real rows: for each
GPU count, a short simulated run (``GPULENS_SIMULATED_GPUS``) writes its rows to JSONL, and each
row is handed to the view's ``write`` and to the old comprehension, alternately, ``--repeat``
times; the median per row is printed with their ratio. verl logs once a step of seconds, so
the figure to compare with is a step, not a millisecond.

    python benchmarks/handoff_cost.py --gpus 1,2,8,16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def rows_for(gpus: int, steps: int) -> list[dict[str, float]]:
    """The rows' values of a short simulated run with ``gpus`` GPUs."""
    import gpulens

    os.environ["GPULENS_BACKEND"] = "simulated"
    os.environ["GPULENS_SIMULATED_GPUS"] = str(gpus)
    path = Path(tempfile.mkdtemp(prefix="handoff-cost-")) / "rows.jsonl"
    with gpulens.Monitor(interval=0.05, sinks=[f"jsonl:{path}"], gpus=list(range(gpus))) as mon:
        for step in range(1, steps + 1):
            time.sleep(0.05)
            mon.log(step, loss=1.0 / step, learning_rate=1e-4)
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "event" not in row:
            out.append({k: float(v) for k, v in row.items()
                        if k not in ("run_id", "step", "time") and isinstance(v, (int, float))})
    return out


def old_write(values: dict[str, float]) -> dict[str, float]:
    """What ``RowHandoff.write`` kept before: every key but ``train/*`` and the step."""
    return {k: v for k, v in values.items()
            if k != "train/global_step" and not k.startswith("train/")}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--gpus", default="1,2,8,16")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from gpulens.integrations.verl import RowHandoff
    from gpulens.model import Row

    lines = ["| GPUs | keys in a row | keys kept (view) | view write (us) | old write (us) | "
             "ratio |", "|---|---|---|---|---|---|"]
    figures: list[dict[str, Any]] = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        rows = rows_for(gpus, args.steps)
        handoff = RowHandoff()
        new_t: list[float] = []
        old_t: list[float] = []
        kept = 0
        for _ in range(args.repeat):
            for i, values in enumerate(rows):
                row = Row(step=i, time=0.0, values=values)
                t0 = time.perf_counter()
                handoff.write(row)
                new_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                old_write(values)
                old_t.append(time.perf_counter() - t0)
                kept = len(handoff.take(i) or {})
        new_us, old_us = 1e6 * statistics.median(new_t), 1e6 * statistics.median(old_t)
        keys = max(len(v) for v in rows)
        figures.append({"gpus": gpus, "keys": keys, "kept": kept, "view_us": new_us,
                        "old_us": old_us, "rows": len(rows)})
        lines.append(f"| {gpus} | {keys} | {kept} | {new_us:.1f} | {old_us:.1f} | "
                     f"{new_us / old_us:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
