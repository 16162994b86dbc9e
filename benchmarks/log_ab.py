"""``Monitor.log()`` latency of two source trees, interleaved, with an A/A arm for the noise.

Each round runs three fresh processes in a shuffled order: tree A (``--a``), tree B (``--b``)
and tree B again (the A/A arm).  Each process starts a monitor over 8 simulated GPUs sampled at
10 Hz with a JSONL sink (the default path: the sampler in its own process), lets it fill a first
window (``--settle-s`` of busy time, 0.3 s), then times ``--calls`` calls of
``log(step, loss=..., learning_rate=..., grad_norm=...)`` ``--gap-us`` apart (a busy-wait
between calls, as ``bench_log.py`` (a) does) and prints the median in microseconds.

``--stub-pipe`` measures only the Python that ``log()`` runs on the training thread: the pipe's
sender is replaced by a function that takes the message and returns (no pickling, no write, so
no wake-up of the engine process and none of the scheduler's noise), the gap is left out, and
each arm prints the best of 5 means over ``--calls`` back-to-back calls.  Found by attribute:
``monitor._transport._tx`` (this tree) or ``monitor._process._tx`` (f9682b0).

Printed: each round's medians, then the paired differences B - A and B - B' (the A/A arm):
their median and [min, max] over rounds.  Verdict: "higher"/"lower" only where the whole B - A
range lies beyond the A/A envelope (+-the largest B - B' seen); otherwise "not separable".
Nothing is asserted.

    python benchmarks/log_ab.py --a /tmp/old/src --b src --rounds 8
    python benchmarks/log_ab.py --a /tmp/old/src --b src --rounds 8 --stub-pipe --calls 200000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
os.environ["GPULENS_BACKEND"] = "simulated"
os.environ["GPULENS_SIMULATED_GPUS"] = "8"
import logging
logging.getLogger("gpulens").setLevel(logging.ERROR)  # the advice rules fire on this load
import gpulens

def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

calls, gap, stub = int(sys.argv[2]), float(sys.argv[3]) * 1e-6, sys.argv[5] == "1"
mon = gpulens.Monitor(interval=0.1, sinks=[f"jsonl:{sys.argv[4]}"], backend="simulated")
mon.start()
busy(float(sys.argv[6]))
if stub:
    holder = getattr(mon, "_transport", None) or getattr(mon, "_process", None)
    tx = holder._tx
    tx.send = lambda obj, force=False: True
    means = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for step in range(1, calls + 1):
            mon.log(step, loss=0.5, learning_rate=3e-4, grad_norm=0.5)
        means.append((time.perf_counter_ns() - t0) / calls / 1e3)
    del tx.send
    mon.stop()
    print(min(means))
    sys.exit(0)
lat = []
for step in range(1, calls + 1):
    busy(gap)
    t0 = time.perf_counter_ns()
    mon.log(step, loss=1.0 / step, learning_rate=3e-4, grad_norm=0.5)
    lat.append(time.perf_counter_ns() - t0)
mon.stop()
print(statistics.median(lat) / 1e3)
"""


def run_arm(src: str, calls: int, gap_us: float, tmp: Path, name: str, stub: bool,
            settle_s: float = 0.3) -> float:
    out = tmp / f"{name}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(src).resolve()), str(calls),
                           str(gap_us), str(out), "1" if stub else "0", str(settle_s)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
    out.unlink(missing_ok=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="tree A's src folder (the reference)")
    p.add_argument("--b", required=True, help="tree B's src folder (the change)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--gap-us", type=float, default=1000.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle-s", type=float, default=0.3,
                   help="busy seconds after start() before the timed calls (the sampler fills "
                   "its first windows)")
    p.add_argument("--stub-pipe", action="store_true",
                   help="time only the Python of log() (the pipe's sender stubbed; see above)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            arms = [("A", args.a), ("B", args.b), ("B'", args.b)]
            rng.shuffle(arms)
            got = {name: run_arm(src, args.calls, args.gap_us, Path(tmp), f"{r}-{name}",
                                 args.stub_pipe, args.settle_s) for name, src in arms}
            rounds.append(got)
            order = " ".join(n for n, _ in arms)
            a, b, b2 = got["A"], got["B"], got["B'"]
            print(f"round {r + 1} ({order}): A {a:.2f} us, B {b:.2f} us, B' {b2:.2f} us",
                  flush=True)
    ba = [x["B"] - x["A"] for x in rounds]
    aa = [x["B"] - x["B'"] for x in rounds]

    def band(d: list[float]) -> tuple[float, float, float]:
        return statistics.median(d), min(d), max(d)

    m_ba, lo_ba, hi_ba = band(ba)
    m_aa, lo_aa, hi_aa = band(aa)
    noise = max(abs(lo_aa), abs(hi_aa))  # the A/A envelope, about 0 (B' is B)
    if lo_ba > noise:
        verdict = "higher"
    elif hi_ba < -noise:
        verdict = "lower"
    else:
        verdict = "not separable"
    print("| figure | median over rounds | [min, max] |")
    print("|---|---|---|")
    for name in ("A", "B", "B'"):
        v = [x[name] for x in rounds]
        what = "log() Python only, best mean" if args.stub_pipe else "log() median"
        print(f"| {what}, {name} | {statistics.median(v):.2f} us | "
              f"[{min(v):.2f}, {max(v):.2f}] |")
    print(f"| B - A (paired by round) | {m_ba:+.2f} us | [{lo_ba:+.2f}, {hi_ba:+.2f}] |")
    print(f"| B - B' (A/A: the method's own noise) | {m_aa:+.2f} us | "
          f"[{lo_aa:+.2f}, {hi_aa:+.2f}] |")
    print(f"verdict: B against A is {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "rounds": rounds,
                                         "stub_pipe": args.stub_pipe, "b_minus_a": ba,
                                         "b_minus_b2": aa,
                                         "verdict": verdict}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
