"""What one phase mark costs the training thread on a GPU host, part by part (issue 18).

``step_work_ab.py`` found the Hugging Face callback's step hooks taking 55-100 us of host time
each on an H100 host, in the stretch after HF's per-step ``isnan(loss)`` sync where the device
waits for the host. A hook does little more than :meth:`StepPhases._mark` (a CUDA event
recorded on the current stream), so this times, per call on the calling thread (``perf_counter``
around a loop of ``--calls``; the median of ``--repeats`` loops, in microseconds a call):

* ``torch.cuda.current_stream()``, the raw ``torch._C._cuda_getCurrentStream``;
* ``torch.cuda.Event(enable_timing=True)`` (made and dropped);
* ``Event.record()`` (the current stream looked up) and ``Event.record(stream)`` (given);
* ``StepPhases(cuda=True)`` marks as gpulens makes them (a step's four, read back as a row's
  ``collect`` would, so events are reused as in a run), per mark;
* each with the device idle and with its queue full (half a second of matrix products
  queued, under the launch queue's depth), and with a gpulens ``Monitor`` running beside (its
  engine process, default settings).

    python benchmarks/mark_cost_gpu.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def probes(torch: Any, phases_cls: Any) -> dict[str, Callable[[], Any]]:
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event(enable_timing=True)
    phases = phases_cls(cuda=True)
    step = [0]

    def marks() -> None:  # one mark a call, a row's collect every 4 (reuse as in a run)
        k = step[0] = step[0] + 1
        (phases.step_begin, phases.before_optimizer, phases.step_end, phases.resume)[k % 4]()
        if k % 40 == 0:
            phases.collect(10)

    return {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch._C._cuda_getCurrentStream(0)": lambda: torch._C._cuda_getCurrentStream(0),
        "torch.cuda.Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
        "Event.record()": event.record,
        "Event.record(stream)": lambda: event.record(stream),
        "StepPhases mark": marks,
    }


def busy(torch: Any, seconds: float) -> None:
    """Queue about ``seconds`` of matrix products (no wait)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10
    for _ in range(int(seconds / per)):
        a @ a


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    import gpulens
    from gpulens.integrations.phases import StepPhases

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    table: dict[str, dict[str, float]] = {}
    for with_monitor in (False, True):
        mon = gpulens.Monitor(interval=0.5, sinks=["jsonl:/tmp/mark_cost.jsonl"]).start() \
            if with_monitor else None
        try:
            for state in ("idle", "queue full"):
                for name, fn in probes(torch, StepPhases).items():
                    if state == "queue full":
                        busy(torch, 0.5)
                    key = f"{state}{', monitor running' if with_monitor else ''}"
                    table.setdefault(name, {})[key] = per_call_us(
                        fn, args.calls if state == "idle" else args.calls // 8, args.repeats)
                    torch.cuda.synchronize()
        finally:
            if mon is not None:
                mon.stop()
    cols = list(next(iter(table.values())))
    lines = [f"# One phase mark's parts, us a call (median of {args.repeats} loops)", "",
             f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; gpulens "
             f"{gpulens.__file__}", "",
             "| call | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in table.items():
        lines.append(f"| `{name}` | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
