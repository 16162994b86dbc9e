"""What a pipe write costs the writer when the reader sleeps on the pipe, and when it polls.

The training thread writes each step mark to the engine process's pipe
(``gpulens.transport.pipe``).
If the reader sleeps in ``read``, every write must wake it and the writer pays for that; a
reader that polls (``gpulens.transport.process`` looks every 20 ms) costs the writer only the
system call.  Prints the median and p99 of ``pickle.dumps`` + ``os.write`` of a mark, 3000
writes 1 ms apart, for each kind of reader.

    .venv/bin/python benchmarks/pipe_wake.py
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import time

READER = """
import os, sys, time
fd, mode = int(sys.argv[1]), sys.argv[2]
if mode == "polls":
    os.set_blocking(fd, False)
while True:
    if mode == "polls":
        time.sleep(0.02)
        try:
            while True:
                if not os.read(fd, 1 << 20):
                    sys.exit(0)
        except BlockingIOError:
            pass
    elif not os.read(fd, 1 << 20):
        sys.exit(0)
"""


def writes(mode: str, n: int = 3000) -> list[int]:
    r, w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", READER, str(r), mode], pass_fds=(r,))
    os.close(r)
    os.set_blocking(w, False)
    scalars = {"loss": 0.5, "learning_rate": 1e-3, "grad_norm": 1.0}
    out: list[int] = []
    for i in range(n):
        t = time.perf_counter_ns()
        os.write(w, pickle.dumps(("m", i, time.monotonic(), time.time(), scalars, None)))
        out.append(time.perf_counter_ns() - t)
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
    os.close(w)
    child.wait()
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 writes each: a smoke test")
    n = 300 if ap.parse_args().quick else 3000
    print("| reader | write median (us) | write p99 (us) |")
    print("|---|---|---|")
    for mode in ("sleeps in read", "polls"):
        ns = writes("polls" if mode == "polls" else "blocks", n)
        print(f"| {mode} | {ns[len(ns) // 2] / 1e3:.1f} | {ns[int(len(ns) * 0.99)] / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
