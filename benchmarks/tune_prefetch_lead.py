"""How a slow warm-up step hides a loader's shortfall from ``gpulens tune``: the DDP sweep of
``tests/support/tune_ddp.py`` (two CPU ranks, gloo; rank 1's loader needs two workers at
batch 16) with a timed window of 3 and of 8 steps, each with rank 0's warm-up step as it is and
0.8 s longer (a first step that compiles, or waits for a slow rank). While the warm-up step
runs, rank 1's one worker fills its prefetch queue (``prefetch_factor`` 2); a window shorter
than the time that queue lasts times only batches made before it opened.

Since the loader's pace (``gpulens.tune.pace``), a trial takes its wait from the worker's own
time per batch where that is more: the mean service time (finish less start) of the trial's
batches begun before the window closed (before service times, the gaps between its batches,
which needed two gaps a worker: three steps here still read the queue).

Prints, per arm, rank 1's data wait (and where it came from) and the agreed throughput at batch
16 with one worker, and the configuration the sweep chose; writes ``--out/<arm>/rank<R>.json``
and ``--out/table.md``.

    python benchmarks/tune_prefetch_lead.py --out /tmp/lead      # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DELAY_S = 0.8


def arm(out: Path, steps: int, delay_s: float) -> list[str]:
    """Run one sweep; its table row."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(ROOT / "tests/support/tune_ddp.py"),
                    str(out), str(steps), str(delay_s)],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    one = [(a, b) for a, b in zip(ranks[0]["local"], ranks[1]["local"], strict=True)
           if a["config"]["batch_size"] == 16 and a["config"]["num_workers"] == 1
           and a["status"] == "ok"]
    result = ranks[0]["result"]
    chosen = result["trials"][result["chosen"]]["config"]
    if one:
        a, b = one[0]
        wait = f"{b['data_wait_pct']:.1f} %"
        rate = f"{2 * min(a['samples_per_s'], b['samples_per_s']):.0f}"
        per_batch = b.get("loader_batch_s")
        by = f"{b.get('data_wait_by')}" + (f" ({per_batch * 1e3:.0f} ms a batch)"
                                           if per_batch is not None else "")
    else:
        wait = rate = by = "not tried"
    return [str(steps), f"{delay_s:g} s", wait, by, rate,
            f"batch {chosen['batch_size']}, {chosen['num_workers']} worker"
            + ("s" if chosen["num_workers"] != 1 else "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, nargs="+", default=[3, 8])
    args = ap.parse_args(argv)
    rows = [arm(args.out / f"steps{s}-delay{d:g}", s, d)
            for s in args.steps for d in (0.0, DELAY_S)]
    head = ["timed steps", "rank 0's warm-up longer by", "rank 1's data wait, batch 16, 1 worker",
            "from (the worker's time per batch)", "samples/s there (job)", "chosen"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                      + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    (args.out / "table.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
