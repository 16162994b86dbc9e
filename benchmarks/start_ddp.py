"""The Hugging Face callback's ``on_train_begin`` under ``torchrun``: with the spare engine
process its ``on_init_end`` prepares (``gpulens.transport.spawn``) and without, on every rank
(issue 18: the start on the training thread at most 0.5 s, at the size users run).

Each rank builds ``--runs`` tiny ``Trainer`` runs a way, the ways alternated (the runs of
``start_split.hf_begin``: a linear model on the rank's GPU, DDP across the ranks), and writes
``rank{R}.md`` and ``rank{R}.json`` (with the wall-clock time each hook was entered) into
``--out``; under DDP a rank's ``on_train_begin`` includes what the monitor's start waits for
from the others (the job's gather). Rank 0, once every rank's file is there, adds
``ranks.md``: per run, each rank's hook end less the last rank's entry (what a hook held the
job beyond the ranks' meeting; the ranks share the host's clock).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/start_ddp.py --out $OUT
    GPULENS_BACKEND=simulated python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/start_ddp.py --runs 1 --out /tmp/start-ddp      # a CPU, gloo

``--laps``: each rank also keeps where its starts went (``laps{R}.txt``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from start_split import hf_begin


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="Trainer runs a way on each rank")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--laps", action="store_true",
                    help="also keep gpulens's start laps (its DEBUG lines '... (s): ...': the "
                         "monitor's start, the engine process's, the engine's own) in "
                         "laps{R}.txt, in the order the runs made them")
    ap.add_argument("--summarize", type=int, metavar="WORLD",
                    help="only rewrite --out's ranks.md from its WORLD ranks' JSON files")
    args = ap.parse_args(argv)
    if args.summarize:
        table = beyond_meeting(args.out, args.summarize, wait_s=0.0)
        (args.out / "ranks.md").write_text(table)
        print(table)
        return 0 if table else 1
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    laps = _keep_laps() if args.laps else None
    got: dict[str, list[float]] = {"with the spare": [], "without": []}
    entered: dict[str, list[float]] = {way: [] for way in got}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            ways = ("with the spare", "without") if i % 2 == 0 else ("without", "with the spare")
            for way in ways:
                folder = Path(tmp) / f"r{i}{'s' if way == 'with the spare' else 'n'}"
                folder.mkdir()
                if laps is not None:
                    laps.append(f"-- run {i}, {way}")
                got[way].append(hf_begin(way == "with the spare", folder, entered[way]))
    lines = [f"rank {rank} of {world}: the HF callback's `on_train_begin` (s)", "",
             "| way | each | median |", "|---|---|---|"]
    lines += [f"| {way} | {', '.join(f'{s:.3f}' for s in runs)} | "
              f"{statistics.median(runs):.3f} |" for way, runs in got.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"rank{rank}.json").write_text(json.dumps({"s": got, "entered": entered},
                                                          indent=1))
    print("\n".join(lines))
    if laps is not None:
        (args.out / f"laps{rank}.txt").write_text("\n".join(laps) + "\n")
    if rank == 0:
        beyond = beyond_meeting(args.out, world)
        if beyond:
            (args.out / "ranks.md").write_text(beyond)
            print(beyond)
    return 0


def _keep_laps() -> list[str]:
    """gpulens's start laps (``gpulens.log.Laps``, said at DEBUG), as they come: the
    ``gpulens`` logger at DEBUG, and a handler that keeps only those lines (the engine's come
    through its pipe, re-emitted in this process)."""
    import logging

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if " (s): " in text:
                kept.append(text)

    log = logging.getLogger("gpulens")
    log.setLevel(logging.DEBUG)
    log.addHandler(Keep(logging.DEBUG))
    return kept


def beyond_meeting(out: Path, world: int, wait_s: float = 60.0) -> str:
    """Per way and run, each rank's hook end less the last rank's entry (s), and the job's:
    the latest end less that entry (what the job's first collective waits for beyond the
    ranks' meeting), from every rank's JSON (waited for up to ``wait_s``); "" if some never
    came."""
    import time

    paths = [out / f"rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        ranks = [json.loads(p.read_text()) for p in paths]
    except (OSError, ValueError):
        return ""
    lines = ["each rank's hook end less the last rank's entry, per run (s); job: the latest", "",
             "| way | " + " | ".join(f"rank {r}" for r in range(world)) + " | job |",
             "|---|" + "---|" * (world + 1)]
    for way in ranks[0]["s"]:
        runs = len(ranks[0]["s"][way])
        meet = [max(rk["entered"][way][i] for rk in ranks) for i in range(runs)]
        beyond = [[rk["entered"][way][i] + rk["s"][way][i] - meet[i] for i in range(runs)]
                  for rk in ranks]
        job = [max(b[i] for b in beyond) for i in range(runs)]
        lines.append(f"| {way} | " + " | ".join(", ".join(f"{x:.3f}" for x in b)
                                                for b in [*beyond, job]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
