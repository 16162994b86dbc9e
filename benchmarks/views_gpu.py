"""Where throughput and MFU go, checked on a real GPU (issue 12 "Everywhere rows go").

A bf16 matrix-product loop whose model FLOPs are exact (``2 n^3`` per product) runs under
``Monitor(dtype="bf16")`` with the JSONL and Prometheus sinks, logging
``log(step, loss=..., tokens=..., flops=...)`` every step.  Then the same run goes through every
view: ``gpulens report`` (HTML and Markdown), a scrape of the Prometheus sink taken before the
run stops, and ``gpulens watch --plain --record`` on the finished record.

    python benchmarks/views_gpu.py                 # one NVIDIA GPU; about half a minute
    python benchmarks/views_gpu.py --quick         # CPU, a simulated GPU: the plumbing only

Prints a Markdown table: the peak gpulens chose for the GPU (name, dtype, TFLOP/s, source, from
the run's metadata), the run's MFU as the report computes it from the rows against MFU by hand
(the loop's FLOPs / its wall-clock time / the peak: they should agree within a few percent,
since each step synchronises before it logs), the MFU of the products alone (CUDA events), the
last MFU the Prometheus sink served, and whether the report states the denominator.  Writes
``run.jsonl``, ``report.html``, ``report.md``, ``metrics.txt`` and ``watch.txt`` to ``--out``
(default ``$OUT/views``, else a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU, simulated GPU, a few steps")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--n", type=int, default=8192, help="matrix size of each product")
    p.add_argument("--products", type=int, default=8, help="products per step")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or (Path(os.environ["OUT"]) / "views" if os.environ.get("OUT")
                       else Path(tempfile.mkdtemp(prefix="gpulens-views-")))
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        os.environ.setdefault("GPULENS_BACKEND", "simulated")
        os.environ.setdefault("GPULENS_SIMULATED_GPUS", "1")
        args.steps, args.products = min(args.steps, 30), 1

    import gpulens
    from gpulens.sinks.prometheus import PrometheusSink

    record = out / "run.jsonl"
    record.unlink(missing_ok=True)
    flops_per_step = 2.0 * args.n**3 * args.products
    tokens_per_step = args.n * args.products  # rows of each product: "tokens" of width n
    step_fn, kernel_s = _workload(args)
    prom = PrometheusSink(port=0)
    mon = gpulens.Monitor(gpus=[0], interval=0.1, sinks=[f"jsonl:{record}", prom],
                          dtype="bf16", flops_per_token=flops_per_step / tokens_per_step)
    mon.start()
    try:
        step_fn()  # warm-up, not logged: the first window starts after it
        mon.log(0)
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            step_fn()
            mon.log(step, loss=1.0 / step, tokens=tokens_per_step, flops=flops_per_step)
        wall = time.perf_counter() - started
        if args.quick:  # a smoke run waits until the last row is served, not longer
            metrics = _scrape_until_step(prom.url, args.steps, timeout=30.0)
        else:
            time.sleep(1.5)  # the last rows reach the Prometheus sink
            with urllib.request.urlopen(prom.url, timeout=10) as r:
                metrics = r.read().decode()
        meta = dict(mon.context.meta) if mon.context is not None else {}
        gpu = mon.context.gpus[0].name if mon.context and mon.context.gpus else "none"
    finally:
        mon.stop()
    (out / "metrics.txt").write_text(metrics)
    cli = [sys.executable, "-m", "gpulens.cli"]
    subprocess.run([*cli, "report", str(record), "-o", str(out / "report.html"), "--markdown",
                    str(out / "report.md")], check=True, capture_output=True, timeout=120)
    watch = subprocess.run([*cli, "watch", "--plain", "--count", "1", "--interval", "0.3",
                            "--gpus", "0", "--record", str(record)], capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
    (out / "watch.txt").write_text(watch.stdout + watch.stderr)

    from gpulens.report import load_jsonl, summarize

    summary = summarize(load_jsonl(record))
    peak = meta.get("peak_tflops")
    tp = summary.throughput
    rows_mfu = tp.mfu_pct if tp is not None else None
    by_hand = (100 * flops_per_step * args.steps / wall / (float(peak) * 1e12)
               if isinstance(peak, int | float) else None)
    kernels = kernel_s()
    products = (100 * flops_per_step * args.steps / kernels / (float(peak) * 1e12)
                if isinstance(peak, int | float) and kernels else None)
    served = _last_value(metrics, "gpulens_train_mfu_percent")
    page = (out / "report.html").read_text()
    figures: list[tuple[str, Any]] = [
        ("GPU (NVML name)", gpu),
        ("peak (run metadata)", f"{meta.get('peak_gpu')}, {meta.get('peak_dtype')}, "
                                f"{peak} TFLOP/s" if peak is not None else "none"),
        ("peak source", meta.get("peak_source", "none")),
        ("steps", args.steps),
        ("FLOPs per step", f"{flops_per_step:.4g}"),
        ("MFU, rows (report, time-weighted) %", _f(rows_mfu)),
        ("MFU by hand (FLOPs / wall clock / peak) %", _f(by_hand)),
        ("rows vs by hand", _f(100 * (rows_mfu / by_hand - 1), "+.2f") + " %"
         if rows_mfu is not None and by_hand else "n/a"),
        ("MFU of the products alone (CUDA events) %", _f(products)),
        ("clock-adjusted MFU, rows %", _f(tp.mfu_clock_adjusted_pct if tp else None)),
        ("MFU while tensor cores busy, rows %", _f(tp.mfu_when_tensor_active_pct if tp else None)),
        ("tokens per joule, rows", _f(tp.per_j if tp else None, ".4g")),
        ("Prometheus gpulens_train_mfu_percent (last row)", _f(served)),
        ("report states the denominator", _states(page, peak)),
        ("watch --record line", watch.stdout.strip().split(" | ")[-1] or watch.stderr.strip()),
    ]
    print("| figure | value |\n|---|---|")
    for name, value in figures:
        print(f"| {name} | {value} |")
    print(f"\nfiles: {out}")
    return 0


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "n/a" if v is None else f"{v:{fmt}}"


def _states(page: str, peak: object) -> str:
    if not isinstance(peak, int | float):
        return "n/a (no peak for this GPU)"
    return "yes" if f"{peak:g} TFLOP/s, the dense" in page else "no"


def _scrape_until_step(url: str, step: int, timeout: float) -> str:
    """The Prometheus sink's page once it serves ``step`` as ``gpulens_train_step`` (the
    last scrape after ``timeout`` seconds otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=10) as r:
            metrics: str = r.read().decode()
        if _last_value(metrics, "gpulens_train_step") == step or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def _last_value(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _workload(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(step, kernel seconds so far)``: products on the GPU, timed with CUDA events; in
    ``--quick`` a sleep that stands for them."""
    if args.quick:
        took: list[float] = []

        def sleep_step() -> None:
            t = time.perf_counter()
            time.sleep(0.03)
            took.append(time.perf_counter() - t)

        return sleep_step, lambda: sum(took[1:])  # without the warm-up
    import torch

    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    events: list[tuple[Any, Any]] = []

    def gpu_step() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.products):
            torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()  # the step ends when its work does: windows are exact
        events.append((start, end))

    def kernels() -> float:
        return sum(s.elapsed_time(e) for s, e in events[1:]) / 1000  # without the warm-up

    return gpu_step, kernels


if __name__ == "__main__":
    sys.exit(main())
