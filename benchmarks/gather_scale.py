"""Cost of gathering the ranks' rows as the job grows: the two-level gather against the flat
all-gather it replaced, side by side, on this host with simulated GPUs (issue 17).

    python benchmarks/gather_scale.py --sizes 2,4,8,16,32 --reps 2 --out DIR

Each run is a job of W ranks over two "nodes": two ``torchrun --nnodes 2`` launches on
localhost sharing a c10d rendezvous (127.0.0.1), each with its own node name
(``GPULENS_NODE_NAME``) and W/2 ranks.  Every rank runs the same loop: sleep ``--step-s``,
``monitor.log(step)``, for ``--steps`` steps, with simulated GPUs (one per rank) and the engine
in a thread of the rank (``isolation="thread"``: 32 sampler processes beside 32 ranks would not
fit 2 cores).  No model, no DDP: what is measured is the gather.

Arms, interleaved in each repetition (order alternating):

* ``flat``: gpulens as of the commit before the two-level gather (``--flat-commit``, default
  ec0b41d), extracted with ``git archive`` into the run's temp dir: every ``log()`` is one
  all-gather of a fixed-size tensor over a gloo group of all ranks;
* ``two``: this tree's ``src`` (the two-level gather).

Measured on every rank (``rank<r>.json`` in the run's folder): each ``log()``'s latency; the
gather threads' CPU seconds (``gpulens-gather`` and rank 0's ``gpulens-gather-rx``,
``/proc/self/task/<tid>/schedstat``, read before ``stop()``); on rank 0
also the gather's time and bytes per row (flat: each all-gather's wall time and its ring bytes,
``2 (W-1) x tensor``; two-level: its gather thread's time at work per row and the bytes its
threads popped from the store), TCP connections the monitor opened (``psutil``, after
``start()`` less before), peak RSS, and the rows in its JSONL and how many were complete
(flat: every rank's GPU in the row; two-level: ``job/ranks == W``).

Writes ``DIR/<arm>-w<W>-r<rep>/rank<r>.json``, the launches' output, ``summary.csv`` and
``summary.md`` (medians over repetitions).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLAT_COMMIT = "ec0b41d"


# -- the rank's side (run under torchrun) --------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import resource
    import threading

    import psutil
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.run_dir)
    exchange: list[tuple[float, int]] = []
    if args.arm == "flat":  # time and size of each all-gather of gpulens's thread
        real = dist.all_gather

        def timed(tensors: Any, tensor: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(tensors, tensor, *a, **k)
            finally:
                if threading.current_thread().name == "gpulens-gather":
                    ring = 2 * (world - 1) * tensor.numel() * tensor.element_size()
                    exchange.append((time.perf_counter() - t0, ring))

        dist.all_gather = timed
    import gpulens

    proc = psutil.Process()
    conns_before = len(proc.net_connections(kind="tcp"))
    rss_before = proc.memory_info().rss
    mon = gpulens.Monitor(interval=args.interval, sinks=[f"jsonl:{out / 'rows.jsonl'}"],
                          isolation="thread")
    t_start = time.perf_counter()
    mon.start()
    start_s = time.perf_counter() - t_start
    conns = len(proc.net_connections(kind="tcp")) - conns_before
    lat: list[float] = []
    for step in range(1, args.steps + 1):
        time.sleep(args.step_s)
        t0 = time.perf_counter()
        mon.log(step, loss=1.0 / step)
        lat.append(time.perf_counter() - t0)
    gather = mon._gather
    cpus = [c for c in (_thread_cpu("gpulens-gather"), _thread_cpu("gpulens-gather-rx"))
            if c is not None]
    thread_cpu = sum(cpus) if cpus else None
    rss = proc.memory_info().rss
    t_stop = time.perf_counter()
    mon.stop()
    stop_s = time.perf_counter() - t_stop
    result: dict[str, Any] = {
        "rank": rank, "world": world, "arm": args.arm, "steps": args.steps,
        "log_s": lat, "start_s": start_s, "stop_s": stop_s, "gather_thread_cpu_s": thread_cpu,
        "tcp_connections_opened": conns, "rss_mb": rss / 1e6,
        "rss_growth_mb": (rss - rss_before) / 1e6,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if args.arm == "flat":
        result["exchanges"] = len(exchange)
        result["exchange_s"] = [t for t, _ in exchange]
        result["exchange_bytes"] = sum(b for _, b in exchange)
    elif gather is not None:
        stats = dict(gather.stats)
        result["gather_stats"] = stats
        result["is_leader"] = gather.is_leader
        channels = [c for c in (gather._channel, getattr(gather, "_rx_channel", None)) if c]
        result["store_bytes_in"] = sum(c.bytes_in for c in channels)
        result["store_bytes_out"] = sum(c.bytes_out for c in channels)
        result["store_ops"] = sum(c.ops for c in channels)
    if rank == 0:
        rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()
                if '"event"' not in line]
        result["rows"] = len(rows)
        if args.arm == "flat":
            result["rows_complete"] = sum(
                all(f"gpu/{r}/util_pct" in row for r in range(world)) for row in rows)
        else:
            result["rows_complete"] = sum(row.get("job/ranks") == world for row in rows)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _thread_cpu(name: str) -> float | None:
    """CPU seconds of this process's thread called ``name`` (``/proc/.../schedstat``: time on
    a CPU in ns, finer than ``stat``'s clock ticks)."""
    import threading

    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            with contextlib.suppress(OSError):
                text = Path(f"/proc/self/task/{t.native_id}/schedstat").read_text()
                return int(text.split()[0]) / 1e9
    return None


# -- the driver ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flat_tree(dest: Path, commit: str) -> Path:
    """``src/`` of ``commit`` (``git archive``) under ``dest``; returns the ``src`` path."""
    data = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest / "flat", filter="data")
    return dest / "flat" / "src"


def run_job(arm: str, world: int, run_dir: Path, src: Path, args: argparse.Namespace) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    t0 = time.monotonic()
    for node in ("a", "b"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
        env.update(PYTHONPATH=str(src), GPULENS_BACKEND="simulated",
                   GPULENS_SIMULATED_GPUS=str(world // 2), GPULENS_NODE_NAME=f"bench-{node}",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", str(world // 2), "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"{arm}{world}",
               str(Path(__file__).resolve()), "--rank-main", "--arm", arm,
               "--run-dir", str(run_dir), "--steps", str(args.steps), "--step-s",
               str(args.step_s), "--interval", str(args.interval)]
        log = open(run_dir / f"launch-{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=args.timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            codes.append(None)
        log.close()
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)
             if (run_dir / f"rank{r}.json").exists()]
    return {"arm": arm, "world": world, "codes": codes, "seconds": time.monotonic() - t0,
            "ranks": ranks}


def summarize(job: dict) -> dict[str, Any]:
    ranks = {r["rank"]: r for r in job["ranks"]}
    r0 = ranks.get(0, {})
    world = job["world"]
    lat = [x for r in ranks.values() for x in r["log_s"]]
    row: dict[str, Any] = {"arm": job["arm"], "world": world, "exit_codes": job["codes"],
                           "ranks_reported": len(ranks)}
    rows = r0.get("rows") or 0
    if job["arm"] == "flat":
        ex = r0.get("exchange_s", [])
        row["rank0_gather_s_per_row"] = statistics.mean(ex) if ex else None
        row["rank0_bytes_per_row"] = r0.get("exchange_bytes", 0) / max(1, len(ex))
        row["rank0_store_ops_per_row"] = 0
    else:
        st = r0.get("gather_stats", {})
        row["rank0_gather_s_per_row"] = st.get("busy_s", 0.0) / max(1, st.get("rows", 0))
        row["rank0_bytes_per_row"] = r0.get("store_bytes_in", 0) / max(1, st.get("rows", 0))
        row["rank0_store_ops_per_row"] = r0.get("store_ops", 0) / max(1, st.get("rows", 0))
    cpu = r0.get("gather_thread_cpu_s")
    row["rank0_gather_cpu_s_per_log"] = cpu / r0["steps"] if cpu is not None and r0 else None
    row["rank0_tcp_opened"] = r0.get("tcp_connections_opened")
    row["rank0_rss_mb"] = r0.get("rss_mb")
    row["rank0_maxrss_mb"] = r0.get("maxrss_mb")
    row["log_s_p50_all_ranks"] = statistics.median(lat) if lat else None
    row["log_s_p99_all_ranks"] = (statistics.quantiles(lat, n=100)[98] if len(lat) >= 2
                                  else None)
    row["log_s_max_all_ranks"] = max(lat) if lat else None
    row["rows"] = rows
    row["rows_complete"] = r0.get("rows_complete")
    row["rank0_stop_s"] = r0.get("stop_s")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="two")
    p.add_argument("--run-dir", default="")
    p.add_argument("--sizes", default="2,4,8,16,32")
    p.add_argument("--arms", default="flat,two")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--flat-commit", default=FLAT_COMMIT)
    p.add_argument("--out", default=os.environ.get("OUT") or "")
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="gather-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory(prefix="gather-scale-trees-") as tmp:
        # a copy of this tree's src: edits made while the benchmark runs do not reach it
        srcs = {"two": Path(shutil.copytree(ROOT / "src", Path(tmp) / "two" / "src"))}
        if "flat" in arms:
            srcs["flat"] = _flat_tree(Path(tmp), args.flat_commit)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        (out / "env.txt").write_text(
            f"python {platform.python_version()} | host cpus {os.cpu_count()} | "
            f"load {os.getloadavg()} | two: {head} (+ working tree) | flat: "
            f"{args.flat_commit}\nargs: {vars(args)}\n")
        summary = []
        for rep in range(args.reps):
            for i, world in enumerate(sizes):
                order = arms if (rep + i) % 2 == 0 else arms[::-1]
                for arm in order:
                    job = run_job(arm, world, out / f"{arm}-w{world}-r{rep}", srcs[arm], args)
                    row = {"rep": rep, **summarize(job)}
                    summary.append(row)
                    print(json.dumps(row), flush=True)
    keys = list(summary[0])
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(summary)
    (out / "summary.md").write_text(markdown(summary, sizes, arms))
    print(markdown(summary, sizes, arms))
    return 0


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(vals) if vals else None


def markdown(summary: list[dict[str, Any]], sizes: list[int], arms: list[str]) -> str:
    cols = [("rank0_gather_s_per_row", "rank 0 gather ms/row", 1e3),
            ("rank0_gather_cpu_s_per_log", "rank 0 gather CPU ms/log", 1e3),
            ("rank0_bytes_per_row", "rank 0 bytes/row", 1.0),
            ("rank0_store_ops_per_row", "rank 0 store ops/row", 1.0),
            ("rank0_tcp_opened", "TCP opened by monitor", 1.0),
            ("rank0_maxrss_mb", "rank 0 peak RSS MB", 1.0),
            ("log_s_p50_all_ranks", "log() p50 us (all ranks)", 1e6),
            ("log_s_p99_all_ranks", "log() p99 us (all ranks)", 1e6),
            ("log_s_max_all_ranks", "log() max ms (all ranks)", 1e3),
            ("rows", "rows", 1.0), ("rows_complete", "complete", 1.0),
            ("rank0_stop_s", "rank 0 stop() s", 1.0)]
    lines = ["| arm | ranks | " + " | ".join(c[1] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for world in sizes:
        for arm in arms:
            rows = [r for r in summary if r["world"] == world and r["arm"] == arm]
            cells = []
            for key, _, scale in cols:
                v = _med(rows, key)
                cells.append("-" if v is None else f"{v * scale:.3g}")
            lines.append(f"| {arm} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
