"""What starting and stopping gpulens costs the training thread, sink by sink (issue 18).

Each arm is a fresh Python process, as a user's script is (a tracker library not yet
imported), running the same loop: ``--steps`` steps of ``--work-ms`` of pure-Python work each
(it needs the GIL, so a gpulens thread that takes it shows), a ``Monitor.log`` every
``--log-every`` steps (a row every half second by default, as a trainer that logs every few
steps: a tracker then keeps up, so ``stop()`` times what stopping costs, not a backlog), more
steps until the sink has caught up (below), then ``stop()``.  Arms:

* ``none``: the loop without gpulens (the baseline of ``loop_s``);
* ``jsonl``: ``sinks=["jsonl:PATH"]`` (first row: a row line in the file);
* ``mlflow-sqlite``: ``sinks=["mlflow"]``, ``MLFLOW_TRACKING_URI=sqlite:///...`` (tables made
  before the rounds; first row: a metric in the database);
* ``mlflow-server``: the same against a loopback ``mlflow server`` that this script starts
  and stops (sqlite behind it; first row: a metric in its database);
* ``wandb-offline``: ``sinks=["wandb"]``, ``WANDB_MODE=offline``, no run of the user's
  (gpulens makes one; first row: handed to ``run.log``, from the monitor's own sink figures).

Per arm and round (arms shuffled in each round): ``init_s`` (``Monitor(...)``), ``start_s``
(``start()`` on the calling thread), ``first_row_s`` (from the ``start()`` call to the first
row in the store), ``stop_s`` (``stop()``, called once the sink has caught up: every row but
the newest stored, so it times stopping, not the flush of what piled up while the sink
opened), ``loop_s`` (the first ``--steps`` steps, against the ``none`` arm's), and the sink's
figures.  Printed: medians with [min, max] over the rounds; written: every round's figures,
raw, as JSON, with the load average before and after (the machine may be shared).

    python benchmarks/start_stop.py [--rounds 7] [--out benchmarks/results/<date>-cpu-start-stop]

Simulated GPUs (``GPULENS_BACKEND=simulated``); CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("none", "jsonl", "mlflow-sqlite", "mlflow-server", "wandb-offline")
FIGURES = ("init_s", "start_s", "first_row_s", "stop_s", "loop_s")
FIRST_ROW_TIMEOUT_S = 180.0


# -- the child: one arm, one round --------------------------------------------------------------
def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        total += sum(i * i for i in range(200))


def _losses_in(db: Path) -> int:
    """``train/loss`` points in an MLflow sqlite store, one a row (0 while it has no table)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM metrics WHERE key = 'train/loss'")
                       .fetchone()[0])
    except sqlite3.Error:
        return 0


def _jsonl_rows(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.strip() and '"event"' not in line)


def child(arm: str, work: Path, steps: int, work_s: float, log_every: int,
          db: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": arm}
    if arm == "none":
        t = time.perf_counter()
        for _ in range(steps):
            _spin(work_s)
        out["loop_s"] = time.perf_counter() - t
        return out
    import gpulens

    sinks = {"jsonl": [f"jsonl:{work / 'rows.jsonl'}"], "mlflow-sqlite": ["mlflow"],
             "mlflow-server": ["mlflow"], "wandb-offline": ["wandb"]}[arm]
    before = _losses_in(db) if db is not None else 0

    def stored(mon: Any) -> int:
        """Rows of this run in the sink's store so far."""
        if arm == "jsonl":
            return _jsonl_rows(work / "rows.jsonl")
        if arm == "wandb-offline":
            return _engine_written(mon) + _local_written(mon)
        assert db is not None
        return _losses_in(db) - before

    t = time.perf_counter()
    mon = gpulens.Monitor(interval=0.1, sinks=sinks, backend="simulated")
    out["init_s"] = time.perf_counter() - t
    t0 = time.perf_counter()
    mon.start()
    out["start_s"] = time.perf_counter() - t0
    # step on until the first row is stored and the sink has caught up (all but the newest
    # row stored): stop() then times stopping, not the flush of a backlog left by the open
    step, logged, loop_start, first, caught_up = 0, 0, time.perf_counter(), None, None
    while step < steps or caught_up is None:
        step += 1
        _spin(work_s)
        if step % log_every == 0:
            mon.log(step, loss=1.0 / step)
            logged += 1
            have = stored(mon)
            now = time.perf_counter() - t0
            if first is None and have > 0:
                first = now
            if first is not None and caught_up is None and have >= logged - 1:
                caught_up = now
        if step == steps:
            out["loop_s"] = time.perf_counter() - loop_start
        if caught_up is None and time.perf_counter() - t0 > FIRST_ROW_TIMEOUT_S:
            break
    out["first_row_s"], out["caught_up_s"] = first, caught_up
    out["steps"], out["rows_logged"] = step, logged
    t = time.perf_counter()
    stats = mon.stop()
    out["stop_s"] = time.perf_counter() - t
    out["sinks"] = {k: {"written": v.written, "dropped": v.dropped} for k, v in stats.items()}
    out["rows_stored"] = stored(mon) if arm != "wandb-offline" else None
    return out


def _local_written(mon: Any) -> int:
    """Rows this process's own sink writers wrote (a tree that wrote W&B from the training
    process: the sink's own figures)."""
    writer = mon._steplogger
    return max((s.written for s in writer.stats().values()), default=0) \
        if writer is not None else 0


def _engine_written(mon: Any) -> int:
    """Rows the engine's sinks wrote, as its latest figures say (sent once a second: a tree
    that writes W&B from the engine process; the run file is no guide, since W&B's offline
    writer flushes it every several seconds)."""
    last = getattr(getattr(mon, "_transport", None), "_last_stats", None)
    if last is None:
        return 0
    return max((s.written for s in dict(last.stats).values()), default=0)


# -- the parent: rounds, servers, the table -------------------------------------------------------
def _env(arm: str, work: Path, mlflow_uri: str | None, src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "WANDB_", "GPULENS_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(src), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")) if p),
               GPULENS_BACKEND="simulated", GPULENS_SIMULATED_GPUS="1",
               MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    if mlflow_uri is not None:
        env["MLFLOW_TRACKING_URI"] = mlflow_uri
    if arm == "wandb-offline":
        env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(work),
                   WANDB_CONFIG_DIR=str(work / "wandb-config"),
                   WANDB_CACHE_DIR=str(work / "wandb-cache"),
                   WANDB_DATA_DIR=str(work / "wandb-data"))
    return env


def run_arm(arm: str, work: Path, args: argparse.Namespace, mlflow_uri: str | None,
            db: Path | None, src: str) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", arm, "--work", str(work), "--steps",
           str(args.steps), "--work-ms", str(args.work_ms), "--log-every", str(args.log_every)]
    if db is not None:
        cmd += ["--db", str(db)]
    done = subprocess.run(cmd, cwd=work, env=_env(arm, work, mlflow_uri, Path(src)),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr_tail"] = done.stderr[-1500:]
    return result


def _make_tables(uri: str, work: Path) -> None:
    code = "import mlflow; mlflow.MlflowClient().search_experiments()"
    subprocess.run([sys.executable, "-c", code], env=_env("mlflow-sqlite", work, uri, ROOT),
                   check=True, capture_output=True, timeout=300)


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):7.3f} [{min(values):.3f}, {max(values):.3f}]")


def table(results: list[dict[str, Any]], arms: list[str]) -> str:
    lines = [f"{'arm':<24}" + "".join(f"{f:>26}" for f in FIGURES)]
    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        cells = []
        for figure in FIGURES:
            values = [float(r[figure]) for r in rows if r.get(figure) is not None]
            cells.append(f"{_fmt(values):>26}")
        lines.append(f"{arm:<24}" + "".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="steps timed as loop_s")
    parser.add_argument("--work-ms", type=float, default=50.0, help="pure-Python work a step")
    parser.add_argument("--log-every", type=int, default=10, help="steps between log() calls")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", default=None, help="folder for the raw JSON and the table")
    parser.add_argument("--src", default=str(ROOT / "src"),
                        help="the gpulens source tree the arms import")
    parser.add_argument("--baseline-src", default=None,
                        help="another tree's src/: each gpulens arm runs with it too, as "
                             "'ARM@baseline', in the same rounds")
    parser.add_argument("--quick", action="store_true",
                        help="1 round, jsonl and none only, steps of 10 ms (a row every 50: "
                        "every half second still): a smoke run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--db", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, Path(args.work), args.steps, args.work_ms / 1000,
                       args.log_every, Path(args.db) if args.db else None)
        print(json.dumps(result))
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.quick:
        args.rounds, arms, args.work_ms, args.log_every = 1, ["none", "jsonl"], 10.0, 50
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    base = Path(tempfile.mkdtemp(prefix="gpulens-start-stop-"))
    server: Any = None
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    try:
        sqlite_db = base / "mlflow-sqlite" / "mlflow.db"
        if "mlflow-sqlite" in arms:
            sqlite_db.parent.mkdir(parents=True)
            _make_tables(f"sqlite:///{sqlite_db}", sqlite_db.parent)
        if "mlflow-server" in arms:
            sys.path.insert(0, str(ROOT))
            from tests.support.mlflow_server import start_mlflow_server

            server = start_mlflow_server(base / "mlflow-server")
        runs = [(arm, args.src) for arm in arms]
        if args.baseline_src:
            runs += [(f"{arm}@baseline", args.baseline_src) for arm in arms if arm != "none"]
        for round_no in range(args.rounds):
            order = runs[:]
            random.shuffle(order)
            for label, src in order:
                arm = label.partition("@")[0]
                work = base / f"r{round_no}-{label}"
                uri, db = None, None
                if arm == "mlflow-sqlite":
                    uri, db = f"sqlite:///{sqlite_db}", sqlite_db
                elif arm == "mlflow-server":
                    uri, db = server.uri, server.root / "mlflow.db"
                result = run_arm(arm, work, args, uri, db, src)
                result["round"], result["arm"], result["src"] = round_no, label, src
                results.append(result)
                print(f"round {round_no} {label}: " + ", ".join(
                    f"{f} {result[f]:.3f}" for f in FIGURES if result.get(f) is not None),
                    flush=True)
    finally:
        if server is not None:
            server.stop()
    text = table(results, [label for label, _ in runs])
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                "python": platform.python_version(), "cpus": os.cpu_count(),
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "versions": _versions(), "rounds": args.rounds, "steps": args.steps,
                "work_ms": args.work_ms, "log_every": args.log_every,
                "src": str(Path(args.src).resolve()),
                "baseline_src": str(Path(args.baseline_src).resolve()) if args.baseline_src
                else None}
        (out / "raw.json").write_text(json.dumps({"meta": meta, "results": results},
                                                 indent=1) + "\n")
        (out / "table.txt").write_text(text + "\n")


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for name in ("mlflow", "wandb", "gpulens"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


if __name__ == "__main__":
    main()
