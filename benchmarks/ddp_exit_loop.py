"""Do distributed runs exit cleanly? Run an example under ``torchrun`` (2 ranks, gloo, CPU,
simulated GPUs) N times in a row and print a tally: passed, failed (exit code), hung (killed at
the timeout), with each run's seconds.

    python benchmarks/ddp_exit_loop.py --example hf --runs 20
    python benchmarks/ddp_exit_loop.py --example lightning --runs 20
    python benchmarks/ddp_exit_loop.py --example hf --runs 8 --stacks DIR   # stacks of a hang

A run passes when torchrun exits 0 within ``--timeout`` seconds, the JSONL record holds the
expected rows, and no process of the job (rank, engine process) is left once torchrun ended.
A hung run's processes are killed (every rank's process group: see
``tests/support/torchrun.py``); with ``--stacks DIR`` their Python and native stacks are taken
first (``py-spy dump --native`` and ``gdb -batch -ex 'thread apply all bt'``, whichever is
installed; ``--py-spy PATH`` names py-spy) and written to ``DIR/run<k>-<pid>.txt``.

``--isolation thread`` runs the sampler in a thread (``GPULENS_ISOLATION=thread``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.jsonl import read_rows  # noqa: E402
from tests.support.torchrun import JobProcess, run_torchrun  # noqa: E402

EXAMPLES = ROOT / "examples"


def example_args(example: str, folder: Path) -> tuple[list[str], Path, list[int]]:
    """(script arguments, JSONL record, steps expected in it)."""
    sink = folder / "rows.jsonl"
    if example == "hf":
        return ([str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(folder / "out"),
                 "--max-steps", "12", "--logging-steps", "4", "--sink", f"jsonl:{sink}"],
                sink, [4, 8, 12])
    if example in ("lightning", "pytorch_lightning"):
        return ([str(EXAMPLES / "lightning_fit.py"), "--package", example, "--save-dir",
                 str(folder), "--max-steps", "12", "--log-every", "4", "--sink",
                 f"jsonl:{sink}"], sink, [3, 7, 11])
    if example == "plain":
        return ([str(EXAMPLES / "plain_loop.py"), "--out", str(sink), "--steps", "30",
                 "--log-every", "10"], sink, [10, 20, 30])
    raise SystemExit(f"unknown example {example!r}")


def take_stacks(procs: list[JobProcess], dest: Path, py_spy: str | None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    for proc in procs:
        parts = [f"pid {proc.pid}: {proc.cmdline}\n"]
        if py_spy:
            done = subprocess.run([py_spy, "dump", "--native", "--pid", str(proc.pid)],
                                  capture_output=True, text=True, timeout=120)
            parts += ["== py-spy dump --native ==\n", done.stdout, done.stderr]
        if shutil.which("gdb"):
            done = subprocess.run(["gdb", "-p", str(proc.pid), "-batch", "-ex",
                                   "thread apply all bt"],
                                  capture_output=True, text=True, timeout=120)
            parts += ["== gdb thread apply all bt ==\n", done.stdout, done.stderr[-2000:]]
        (dest.parent / f"{dest.name}-{proc.pid}.txt").write_text("".join(parts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", default="hf",
                   choices=("hf", "lightning", "pytorch_lightning", "plain"))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--real-gpus", action="store_true",
                   help="sample the machine's GPUs (NVML) instead of simulated ones")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is hung")
    p.add_argument("--isolation", choices=("auto", "process", "thread"), default=None)
    p.add_argument("--stacks", type=Path, default=None, help="folder for stacks of hung ranks")
    p.add_argument("--py-spy", default=shutil.which("py-spy"))
    p.add_argument("--json", type=Path, default=None, help="also write every run's result here")
    args = p.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.update(OMP_NUM_THREADS="1")
    if not args.real_gpus:
        env["GPULENS_BACKEND"] = "simulated"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"),
                                                    env.get("PYTHONPATH", "")) if p)
    if args.isolation:
        env["GPULENS_ISOLATION"] = args.isolation
    import torch

    gpus = "real GPUs sampled (NVML)" if args.real_gpus else "simulated GPUs sampled"
    print(f"# {args.runs} torchrun runs of the {args.example} example, 2 ranks (gloo, training "
          f"on CPU; {gpus}), timeout {args.timeout:.0f} s, "
          f"isolation={args.isolation or 'default'}")
    print(f"# python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print("| run | result | seconds | note |")
    print("|---|---|---|---|")
    tally = {"passed": 0, "failed": 0, "hung": 0}
    records = []
    for k in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="gpulens-ddp-exit-") as tmp:
            folder = Path(tmp)
            script, sink, steps = example_args(args.example, folder)
            on_timeout = None
            if args.stacks is not None:
                dest = args.stacks / f"run{k}"

                def on_timeout(procs: list[JobProcess], dest: Path = dest) -> None:
                    take_stacks(procs, dest, args.py_spy)

            res = run_torchrun(script, cwd=folder, env=env, timeout=args.timeout,
                               on_timeout=on_timeout)
            note = ""
            if res.timed_out:
                result = "hung"
                note = f"killed after {args.timeout:.0f} s"
            elif res.returncode != 0:
                result = "failed"
                lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
                note = f"exit {res.returncode}: " + (lines[-1][:120] if lines else "")
                if "terminate called" in res.stderr:
                    note += " [terminate called without an active exception]"
            elif res.leftovers:
                result = "failed"
                note = "left running: " + "; ".join(p.cmdline[:80] for p in res.leftovers)
            else:
                got = []
                if sink.exists():
                    got = [row["step"] for row in read_rows(sink)]
                if got != steps:
                    result, note = "failed", f"rows at steps {got}, expected {steps}"
                else:
                    result = "passed"
            tally[result] += 1
            records.append({"run": k, "result": result, "seconds": round(res.seconds, 2),
                            "note": note, "returncode": res.returncode,
                            "stderr_tail": res.stderr[-3000:] if result != "passed" else ""})
            print(f"| {k} | {result} | {res.seconds:.1f} | {note} |", flush=True)
    print(f"\nTally: {tally['passed']} passed, {tally['failed']} failed, {tally['hung']} hung "
          f"of {args.runs} (load {os.getloadavg()[0]:.2f} at the end)")
    if args.json is not None:
        args.json.write_text(json.dumps({"tally": tally, "runs": records}, indent=1))
    return 0 if tally["passed"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
