"""Where ``Monitor.start()`` spends its time on this host (issue 18: start on the training
thread at most 0.5 s).

Two arms, ``--repeat`` times each, alternated, each with a JSONL sink:

* ``spawned`` (``isolation="process"``, the default's choice): ``start()`` and ``stop()`` on
  the calling thread, s;
* ``thread`` (``isolation="thread"``: the engine in the calling process): ``start()`` under
  ``cProfile``, and the time inside each of the engine's start phases (the NVML source's open,
  each GPU's device and info, the sinks' open, the sampler's start with its first sample), s.

The spawned arm's ``start()`` less the thread arm's is about the engine process's spawn and
imports. Prints Markdown; ``--json`` writes every figure and the thread arm's top functions.

    python benchmarks/start_split.py --repeat 5 --json $OUT/start_split.json   # a GPU host
    GPULENS_BACKEND=simulated python benchmarks/start_split.py --repeat 2      # anywhere
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = {
    "nvml open": ("gpulens/engine/engine.py", "_open_source"),
    "GPUs chosen": ("gpulens/engine/engine.py", "_choose_gpus"),
    "sinks open": ("gpulens/sinks/writer.py", "open"),
    "sampler start": ("gpulens/engine/sampler.py", "start"),
    "engine start (all)": ("gpulens/engine/engine.py", "start"),
}
"""Phase -> (file suffix, function name) in the profile; cumulative seconds."""


def phases(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each of :data:`PHASES` in a profile (absent: not called)."""
    out: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for label, (suffix, name) in PHASES.items():
        spent = [v[3] for (file, _, func), v in raw.items()
                 if func == name and file.replace("\\", "/").endswith(suffix)]
        if spent:
            out[label] = max(spent)
    return out


def one(isolation: str, folder: Path, profile: bool) -> dict[str, Any]:
    import gpulens

    mon = gpulens.Monitor(sinks=[f"jsonl:{folder / 'rows.jsonl'}"],
                          isolation="thread" if isolation == "thread" else "process")
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    mon.start()
    if prof is not None:
        prof.disable()
    start_s = time.perf_counter() - t0
    mon.log(1)
    t1 = time.perf_counter()
    mon.stop()
    out: dict[str, Any] = {"start_s": start_s, "stop_s": time.perf_counter() - t1}
    if prof is not None:
        stats = pstats.Stats(prof)
        out["phases_s"] = phases(stats)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
        out["top"] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"spawned": [], "thread": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for arm in ("spawned", "thread") if i % 2 == 0 else ("thread", "spawned"):
                folder = Path(tmp) / f"{arm}{i}"
                folder.mkdir()
                runs[arm].append(one(arm, folder, profile=arm == "thread"))
    lines = ["| arm | start() s, each | median | stop() s, median |", "|---|---|---|---|"]
    for arm, got in runs.items():
        starts = [r["start_s"] for r in got]
        lines.append(f"| {arm} | {', '.join(f'{s:.3f}' for s in starts)} | "
                     f"{statistics.median(starts):.3f} | "
                     f"{statistics.median(r['stop_s'] for r in got):.3f} |")
    labels = [p for p in PHASES if any(p in r.get("phases_s", {}) for r in runs["thread"])]
    medians = [statistics.median(r["phases_s"].get(p, 0.0) for r in runs["thread"])
               for p in labels]
    lines += ["", "Inside the thread arm's `start()` (median over its runs, s):", "",
              "| " + " | ".join(labels) + " |", "|" + "---|" * len(labels),
              "| " + " | ".join(f"{m:.3f}" for m in medians) + " |"]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
