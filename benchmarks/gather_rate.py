"""Cost of the rank gather when a loop logs every step (the h200x4-call3 regression, on CPU).

    python benchmarks/gather_rate.py --nproc 4 --steps 200 --out DIR
    python benchmarks/gather_rate.py --nproc 4 --nodes 2 --arms process --out DIR  # 2 nodes

Each arm is one ``torchrun --standalone --nproc-per-node N`` launch (gloo, simulated GPUs: one
per rank).  Every rank runs the same loop for ``--steps`` steps: ``--work-ms`` of busy CPU work
(a tight Python loop: it holds the GIL, as a training thread's Python does), one gloo
all-reduce of a small tensor (so the slowest rank sets every rank's pace, as DDP's does), then
``mon.log(step, loss=...)``.  Arms, run one after the other in each repetition:

* ``off``: no monitor (the baseline);
* ``process``: ``gpulens.Monitor(interval=0.1, sinks=["jsonl:..."])`` (the engine in a process
  of its own, the default);
* ``thread``: the same with ``isolation="thread"``.

Per rank (``<arm>-r<rep>/rank<r>.json``): the mean step time after ``--warmup`` steps, the CPU
seconds of each of gpulens's threads by name (``/proc/self/task/<tid>/stat``, before
``stop()``), the gather's counters (``JobGather.stats``: rows, wall and CPU seconds at work),
and with ``--sample`` a picture of where gpulens's threads spend their time (their stacks'
innermost gpulens frame, sampled every 5 ms by a thread of the rank: it costs GIL time itself,
so use it to look, not to time).  Printed: each arm's slowest rank's mean step and its ratio to
``off``; ``summary.json`` holds it all.  On a 2-core machine 4 ranks are slow: read ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads whose name starts with gpulens,
    summed by name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for t in threading.enumerate():
        if not t.name.startswith("gpulens") or t.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[t.name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


class _Sampler(threading.Thread):
    """Counts, every ``period`` s, the innermost gpulens frame (file:function) of each gpulens
    thread that is not waiting."""

    def __init__(self, period: float = 0.005) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.period = period
        self.counts: collections.Counter[str] = collections.Counter()
        self.stop_flag = threading.Event()

    def run(self) -> None:
        names = {}
        while not self.stop_flag.wait(self.period):
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                if not name.startswith("gpulens"):
                    continue
                f: Any = frame
                where = None
                while f is not None:
                    code = f.f_code
                    if "gpulens" in code.co_filename:
                        where = f"{Path(code.co_filename).name}:{code.co_name}:{f.f_lineno}"
                        break
                    f = f.f_back
                if where is not None:
                    self.counts[f"{name} {where}"] += 1


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.run_dir)
    mon: Any = None
    if args.nodes > 1:  # simulated nodes: this rank's node as a multi-node launcher says it
        per = dist.get_world_size() // args.nodes
        os.environ.update(GROUP_RANK=str(rank // per), LOCAL_RANK=str(rank % per),
                          GPULENS_NODE_NAME=f"sim-node{rank // per}")
    if args.arm != "off":
        import gpulens

        mon = gpulens.Monitor(interval=0.1, sinks=[f"jsonl:{out / 'rows.jsonl'}"],
                              isolation=args.arm)
        mon.start()
    sampler = _Sampler() if args.sample and args.arm != "off" else None
    if sampler is not None:
        sampler.start()
    x = torch.ones(16)
    dist.barrier()
    times: list[float] = []
    work = args.work_ms / 1000.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        end = t0 + work
        n = 0
        while time.perf_counter() < end:
            n += 1
        dist.all_reduce(x)
        if mon is not None:
            mon.log(step, loss=1.0 / (step + 1))
        times.append(time.perf_counter() - t0)
    cpu = _thread_cpu()
    gather = mon._gather if mon is not None else None
    if sampler is not None:
        sampler.stop_flag.set()
        sampler.join()
    if mon is not None:
        mon.stop()
    dist.barrier()
    kept = times[args.warmup:]
    result = {
        "rank": rank, "arm": args.arm, "steps": args.steps,
        "mean_step_ms": 1000 * sum(kept) / len(kept),
        "max_step_ms": 1000 * max(kept),
        "thread_cpu_s": cpu,
        "gather_stats": dict(gather.stats) if gather is not None else None,
        "role": (None if gather is None else
                 "writer" if gather.is_writer else "leader" if gather.is_leader else "rank"),
        "samples": dict(sampler.counts.most_common(12)) if sampler is not None else None,
    }
    if rank == 0 and mon is not None:
        lines = (out / "rows.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if '"event"' not in line]
        result["rows"] = len(rows)
        result["rows_whole"] = sum(  # rows that held every rank of every node
            r.get("job/ranks") == dist.get_world_size() and r.get("job/nodes") == args.nodes
            and not r.get("job/partial") for r in rows)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_arm(arm: str, run_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(PYTHONPATH=str(ROOT / "src"), GPULENS_BACKEND="simulated",
               GPULENS_SIMULATED_GPUS=str(max(1, args.nproc // args.nodes)),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), "--master-port", str(_free_port()), str(Path(__file__).resolve()),
           "--rank-main", "--arm", arm, "--run-dir", str(run_dir), "--steps", str(args.steps),
           "--work-ms", str(args.work_ms), "--warmup", str(args.warmup),
           "--nodes", str(args.nodes)]
    if args.sample:
        cmd.append("--sample")
    with open(run_dir / "launch.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout).returncode
    if code:
        print(f"{arm}: torchrun exited {code}; see {run_dir / 'launch.log'}")
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(args.nproc)
            if (run_dir / f"rank{r}.json").exists()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="off")
    p.add_argument("--run-dir", default="")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--nodes", type=int, default=1,
                   help="split the ranks into this many simulated nodes (GROUP_RANK, "
                        "LOCAL_RANK and GPULENS_NODE_NAME set per rank before the monitor)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--work-ms", type=float, default=3.0)
    p.add_argument("--arms", default="off,process,thread")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--sample", action="store_true")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="gather-rate-out")
    args = p.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    out = Path(args.out)
    summary: dict[str, Any] = {"args": vars(args), "runs": []}
    for rep in range(args.reps):
        for arm in args.arms.split(","):
            ranks = run_arm(arm, out / f"{arm}-r{rep}", args)
            summary["runs"].append({"arm": arm, "rep": rep, "ranks": ranks})
            for r in ranks:
                print(f"rep {rep} {arm:8s} rank {r['rank']} ({r['role']}): "
                      f"{r['mean_step_ms']:.2f} ms/step (max {r['max_step_ms']:.1f}), "
                      f"threads' CPU {json.dumps(r['thread_cpu_s'])}, "
                      f"gather {json.dumps(r['gather_stats'])}"
                      + (f", rows {r['rows']}" if "rows" in r else ""))
                if r.get("samples"):
                    for k, v in r["samples"].items():
                        print(f"      {v:5d}  {k}")
    by_arm: dict[str, list[float]] = collections.defaultdict(list)
    for run in summary["runs"]:
        if run["ranks"]:
            by_arm[run["arm"]].append(max(r["mean_step_ms"] for r in run["ranks"]))
    base = min(by_arm.get("off", [float("nan")]))
    summary["slowest_rank_mean_step_ms"] = dict(by_arm)
    for arm, vals in by_arm.items():
        best = min(vals)
        print(f"{arm:8s} slowest rank's mean step: {best:.2f} ms (best of {len(vals)}), "
              f"ratio to off {best / base:.2f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
